"""The second model family: a dense Llama (transformers' LlamaForCausalLM) against transformers on the
same checkpoints, float32, on one rank and on two; and the registry that picks a family by the
checkpoint's architecture, refusing others before any weight is read.

Llama checkpoints keep q_proj and k_proj rows in rotate-half order and warpspec's attention rotates
interleaved pairs (workers/models/llama.py): a wrong re-ordering, or one that splits a head across
ranks, moves the logits far past the bounds below."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_checkpoints import load_llama_reference, make_llama_checkpoint, reference_greedy, reference_logprobs
from helpers.steps import build_step
from warpspec import LLM, SamplingParams
from warpspec.workers.errors import CheckpointError
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.loader import load_model
from warpspec.workers.models.llama import LlamaForCausalLM
from warpspec.workers.models.registry import ARCHITECTURES, load_model_config
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CONFIGS = {
    # GQA 2:1, untied, default RoPE.
    "gqa2_untied": dict(),
    # Multi-head (4 KV heads), tied embeddings, Llama 3.1 RoPE scaling.
    "mha_tied_llama3": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE),
}
NEW_TOKENS = 24


def _prompt(seed: int, length: int = 40) -> list[int]:
    return torch.randint(3, 160, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])


def test_the_registry_serves_the_checkpoint_with_its_family(checkpoint):
    config = load_model_config(checkpoint)
    assert config.architecture == "LlamaForCausalLM" and ARCHITECTURES[config.architecture] is LlamaForCausalLM
    assert isinstance(load_model(checkpoint, "float32"), LlamaForCausalLM)


def test_prompt_logprobs_match_transformers_at_every_position(checkpoint):
    reference = load_llama_reference(checkpoint)
    prompt = _prompt(1)
    expected = reference_logprobs(reference, prompt)
    runner = ModelRunner(checkpoint, "float32", CacheConfig(block_size=4, num_blocks=16))
    assert not runner.kv_layout.is_hybrid  # no layer attends within a chunk
    step = build_step(runner, [SequenceStep(prompt, 0, list(range(15, 5, -1)), logits_from=0)])
    got = torch.log_softmax(runner.execute(step).logits, dim=-1)
    assert (got - expected).abs().max().item() < 1e-4


def test_greedy_matches_transformers_through_the_engine(checkpoint):
    """Chunked prefill (8 tokens a step), decode over several blocks, a batch of three."""
    reference = load_llama_reference(checkpoint)
    prompts = [_prompt(seed, length) for seed, length in ((2, 5), (3, 17), (4, 30))]
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    with LLM(str(checkpoint), dtype="float32", block_size=4, max_num_batched_tokens=8) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_two_ranks_split_the_heads_and_match_transformers(ray_cluster, tmp_path):
    """Each rank re-orders only whole heads of its own rows (2 query heads and 1 KV head each)."""
    checkpoint = make_llama_checkpoint(tmp_path / "llama")
    reference = load_llama_reference(checkpoint)
    prompt = _prompt(5, 21)
    expected = reference_greedy(reference, prompt, NEW_TOKENS)
    with LLM(str(checkpoint), dtype="float32", num_workers=2) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected


def _write_config(folder, **config) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))


def test_an_architecture_without_a_family_is_refused_before_any_weight_loads(tmp_path):
    # Only config.json: had loading gone on, the missing weights would be the error.
    _write_config(tmp_path / "qwen", architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    message = (r"unsupported architecture \['Qwen3MoeForCausalLM'\]; warpspec serves Llama4ForCausalLM, "
               "Llama4ForConditionalGeneration, LlamaForCausalLM")
    with pytest.raises(CheckpointError, match=message):
        LLM(str(tmp_path / "qwen"))
    _write_config(tmp_path / "untyped", model_type="mistral")
    with pytest.raises(CheckpointError, match="unsupported model_type 'mistral' .*warpspec serves llama4_text"):
        load_model_config(tmp_path / "untyped")


def test_a_llama_with_biases_is_refused_naming_the_field(tmp_path):
    _write_config(tmp_path / "biased", architectures=["LlamaForCausalLM"], attention_bias=True, vocab_size=8,
                  hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(CheckpointError, match="config.json: attention_bias is true"):
        load_model_config(tmp_path / "biased")
