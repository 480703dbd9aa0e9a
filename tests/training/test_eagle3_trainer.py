"""`warpspec train-draft` learns, writes the public format, and the result decodes losslessly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from warpspec import LLM, SamplingParams
from warpspec.training.eagle3_trainer import DraftTrainer, TrainConfig, unrolled_logits
from warpspec.training.random_checkpoint import create_random_checkpoint
from warpspec.workers.models.eagle3_draft import Eagle3Config, Eagle3Draft


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Real text that is always on disk: Python's own standard library sources."""
    stdlib = Path(sys.modules["os"].__file__).parent
    path = tmp_path_factory.mktemp("corpus") / "stdlib.txt"
    path.write_text("\n\n".join(p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[60:90]))
    return path


@pytest.mark.slow
def test_training_improves_agreement_and_writes_a_loadable_draft(tmp_path, corpus):
    target = create_random_checkpoint(tmp_path / "target", "tiny", std=0.3)
    config = TrainConfig(target=str(target), data=str(corpus), out=str(tmp_path / "draft"), steps=60, seq_len=48,
                         batch_size=4, draft_vocab_size=128, ttt_steps=2)
    trainer = DraftTrainer(config)
    before = trainer.validate()
    result = trainer.train()
    # Measured here: top-1 agreement with the target goes from ~0.004 to ~0.04 in 60 steps.
    assert all(after > 2 * start for after, start in zip(result["val_agreement"], before, strict=True))
    saved = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["draft_vocab_size"] == 128
    prompts = ["def main():", "import os"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(target), dtype="float32") as llm:
        expected = llm.generate(prompts, params)
    with LLM(str(target), dtype="float32", draft=str(tmp_path / "draft"), compile_draft=False) as llm:
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_bad_training_input(tmp_path, corpus):
    target = create_random_checkpoint(tmp_path / "target", "tiny")
    with pytest.raises(ValueError, match="seq_len 4 is too short for 3 unrolled steps"):
        TrainConfig(target=str(target), data=str(corpus), out=str(tmp_path / "o"), seq_len=4)
    with pytest.raises(ValueError, match="not found"):
        DraftTrainer(TrainConfig(target=str(target), data=str(tmp_path / "none.txt"), out=str(tmp_path / "o")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "wrong field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a 'text' or 'token_ids' field"):
        DraftTrainer(TrainConfig(target=str(target), data=str(bad), out=str(tmp_path / "o")))


def test_the_draft_reads_the_layers_asked_for(tmp_path, corpus):
    target = create_random_checkpoint(tmp_path / "target", "tiny")  # 4 layers
    config = TrainConfig(target=str(target), data=str(corpus), out=str(tmp_path / "o"), aux_layer_ids=(0, 1, 3))
    assert DraftTrainer(config).draft.config.aux_layer_ids == (0, 1, 3)
    assert DraftTrainer(TrainConfig(target=str(target), data=str(corpus), out=str(tmp_path / "o"))
                        ).draft.config.aux_layer_ids == (2, 2, 1)  # (2, L // 2, L - 3)
    with pytest.raises(ValueError, match=r"aux_layer_ids \[1, 3, 4\] must name layers of the target, 0 to 3"):
        DraftTrainer(TrainConfig(target=str(target), data=str(corpus), out=str(tmp_path / "o"),
                                 aux_layer_ids=(1, 3, 4)))
    with pytest.raises(ValueError, match=r"aux_layer_ids must be three layer ids, got \[1, 3\]"):
        TrainConfig(target=str(target), data=str(corpus), out=str(tmp_path / "o"), aux_layer_ids=(1, 3))


def test_unrolled_steps_attend_as_inference_does():
    """Each unrolled step's logits equal a chain run the way the proposer runs it: a KV cache holding
    the target-fed keys of the context, then each draft token appended with the previous draft
    output as its feature. Before chain attention, steps 1 and 2 attended to their own step's keys
    at every earlier position, which inference never gives them, and this failed."""
    torch.manual_seed(0)
    config = Eagle3Config(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, vocab_size=50, draft_vocab_size=20, rms_norm_eps=1e-5,
                          rope_theta=10000.0, aux_layer_ids=(0, 1, 2))
    draft = Eagle3Draft(config, torch.randn(50, 32), torch.float64)
    with torch.no_grad():
        for param in draft.parameters():
            param.normal_(0.0, 0.5)
    length, num_steps = 9, 3
    inputs, features = torch.randint(0, 50, (1, length)), torch.randn(1, length, 96, dtype=torch.float64)
    with torch.no_grad():
        trained = unrolled_logits(draft, inputs, features, num_steps)

        groups = config.num_attention_heads // config.num_key_value_heads

        def run(token: int, feature: torch.Tensor, position: int, keys: list, values: list):
            # One token through the draft with a growing cache, as a decode step: [1, ...] rows.
            q, k, v, residual = draft.before_attention(torch.tensor([token]), feature[None], torch.tensor([position]))
            keys.append(k[0].repeat_interleave(groups, dim=0))
            values.append(v[0].repeat_interleave(groups, dim=0))
            scores = torch.einsum("hd,thd->ht", q[0], torch.stack(keys)) * config.head_dim**-0.5
            attn = torch.einsum("ht,thd->hd", scores.softmax(-1), torch.stack(values))
            logits, prenorm = draft.after_attention(attn.reshape(1, -1), residual)
            return logits[0], prenorm[0]

        for start in range(length - num_steps + 1):
            keys, values = [], []
            for p in range(start + 1):  # the catch-up: target features up to the chain's start
                logits, prenorm = run(int(inputs[0, p]), features[0, p], p, keys, values)
            for step in range(num_steps):
                if step:
                    p = start + step
                    logits, prenorm = run(int(inputs[0, p]), prenorm, p, keys, values)
                torch.testing.assert_close(trained[step][0, start + step], logits)
