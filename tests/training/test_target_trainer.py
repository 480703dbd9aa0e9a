"""`warpspec train-target`: the corpus split, the tokenizer, the training forward (equal to
transformers' Llama4ForCausalLM), learning, resuming, and the exported Hugging Face folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers.hf_checkpoints import load_reference, reference_logprobs
from warpspec.training.causal_lm import causal_lm_logits
from warpspec.training.corpus import clean, read_documents, split_documents
from warpspec.training.target_trainer import TargetTrainConfig, TargetTrainer
from warpspec.workers.checkpoint_writer import save_checkpoint
from warpspec.workers.models.llama4 import Llama4ForCausalLM
from warpspec.workers.models.registry import model_config_from_dict

# Chunked attention (chunk 16 < seq_len 32) on RoPE layers, layer 3 NoPE, MoE on odd layers, tied head.
SMALL_MODEL = dict(vocab_size=384, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                   attention_chunk_size=16, max_position_embeddings=256, tie_word_embeddings=True,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Llama4ForCausalLM"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder of real documents that is always on disk: the standard library's sources as .txt."""
    folder = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sys.modules["os"].__file__).parent
    for path in sorted(stdlib.glob("*.py"))[:40]:
        (folder / f"{path.stem}.txt").write_text(path.read_text(errors="ignore"))
    return folder


def test_clean_drops_heading_rules_and_blank_runs():
    assert clean("Title\n=====\n\n\n\nBody text.\n----\nMore") == "Title\n\nBody text.\nMore"


def test_split_is_by_document_and_deterministic(corpus):
    docs = read_documents([str(corpus)])
    train, val = split_documents(docs, val_percent=20)
    assert len(train) + len(val) == len(docs) and val and train
    assert {d.path for d in train}.isdisjoint(d.path for d in val)
    assert [d.path for d in split_documents(read_documents([str(corpus)]), 20)[1]] == [d.path for d in val]


def test_missing_corpus_names_the_install_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install --no-install-recommends linux-doc-6.1"):
        read_documents([str(tmp_path / "absent")])


def test_training_forward_matches_transformers(tmp_path):
    config = model_config_from_dict(SMALL_MODEL)
    model = Llama4ForCausalLM(config, torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight")
                        else torch.randn(param.shape, generator=generator) * 0.2)
    save_checkpoint(model, tmp_path)
    prompt = torch.randint(3, 384, (40,), generator=generator).tolist()  # 40 > chunk 16: chunks matter
    expected = reference_logprobs(load_reference(tmp_path), prompt)
    with torch.no_grad():
        got = torch.log_softmax(causal_lm_logits(model, torch.tensor([prompt]))[0], dim=-1)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def train_config(corpus: Path, tmp_path: Path, steps: int) -> TargetTrainConfig:
    return TargetTrainConfig(out=str(tmp_path / "out"), work_dir=str(tmp_path / "work"), corpus=[str(corpus)],
                             model=dict(SMALL_MODEL), seq_len=32, batch_size=8, steps=steps, lr=1e-2,
                             warmup_steps=5, eval_every=10, save_every=10, val_windows=16, val_percent=20)


@pytest.mark.slow
def test_trains_resumes_and_exports_a_transformers_checkpoint(corpus, tmp_path):
    first = TargetTrainer(train_config(corpus, tmp_path, steps=10))
    initial = first.validation_perplexity()
    first.train()
    resumed = TargetTrainer(train_config(corpus, tmp_path, steps=30))
    assert resumed.step == 10 and len(resumed.history) == 1  # continued from the saved state
    report = resumed.train()
    assert [h["step"] for h in report["history"]] == [10, 20, 30]
    # From random (perplexity ~ vocab size 384) to well below it; measured here: 377 -> 133.
    assert report["val_perplexity"] < initial / 2
    out = tmp_path / "out"
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["Llama4ForCausalLM"] and saved["dtype"] == "bfloat16"
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|end_of_text|>"
    reference = load_reference(out)  # transformers loads the export
    prompt = [1, 40, 41, 42, 43]
    with torch.no_grad():
        got = torch.log_softmax(causal_lm_logits(resumed.model, torch.tensor([prompt]))[0], dim=-1)
    # bf16 weights against the float32 ones they were rounded from.
    torch.testing.assert_close(reference_logprobs(reference, prompt), got, atol=0.15, rtol=0.05)


def test_bad_training_config(tmp_path):
    with pytest.raises(ValueError, match="steps must be at least 1, got 0"):
        TargetTrainConfig(out=str(tmp_path), steps=0)
    with pytest.raises(ValueError, match="val_percent must be in 1..49, got 60"):
        TargetTrainConfig(out=str(tmp_path), val_percent=60)
