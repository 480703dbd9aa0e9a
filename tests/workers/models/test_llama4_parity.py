"""warpspec's Llama 4 against transformers' on the same checkpoints, float32.

Each config switches on the features a Llama 4 checkpoint can combine; prompts are longer than the
attention chunk so chunked-local and NoPE layers differ, and floor_scale is small so temperature
tuning changes the NoPE queries at the positions used (scale = 1 + attn_scale*log1p(floor((p+1)/4)))."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.hf_checkpoints import (
    load_reference,
    make_multimodal_checkpoint,
    make_text_checkpoint,
    reference_greedy,
    reference_logprobs,
)
from helpers.steps import build_step
from warpspec import LLM, SamplingParams
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CONFIGS = {
    # MoE on every layer, top-1, QK-norm, GQA 4:1 (4 query heads, 1 KV head), layer 3 NoPE, untied.
    "moe_every_layer_top1_qknorm_gqa4": dict(
        interleave_moe_layer_step=1, num_experts_per_tok=1, use_qk_norm=True, attention_chunk_size=8,
        floor_scale=4, attn_scale=0.5),
    # MoE every other layer, top-2, no QK-norm, GQA 1:1, tied embeddings, llama3 RoPE scaling.
    "moe_interleaved_top2_tied_gqa1_llama3": dict(
        interleave_moe_layer_step=2, num_experts_per_tok=2, use_qk_norm=False, num_key_value_heads=4,
        tie_word_embeddings=True, attention_chunk_size=16, floor_scale=4, attn_scale=0.3,
        rope_parameters=LLAMA3_ROPE),
    # Explicit moe_layers, NoPE on every 2nd layer, no temperature tuning, GQA 2:1, sharded safetensors.
    "explicit_layers_sharded_gqa2": dict(
        moe_layers=[1, 2], no_rope_layers=[1, 0, 1, 0], attn_temperature_tuning=False, num_key_value_heads=2,
        attention_chunk_size=8, max_shard_size="40KB"),
}
PROMPT_LEN, NEW_TOKENS = 40, 32


def _prompt(seed: int, length: int = PROMPT_LEN, vocab: int = 160) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[*CONFIGS, "multimodal"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "multimodal":
        make_multimodal_checkpoint(path, attention_chunk_size=8, floor_scale=4, interleave_moe_layer_step=2)
    else:
        make_text_checkpoint(path, **CONFIGS[request.param])
    return path


def test_prompt_logprobs_match_transformers_at_every_position(checkpoint):
    reference = load_reference(checkpoint)
    prompt = _prompt(1)
    expected = reference_logprobs(reference, prompt)
    # Full vocabulary, every position, straight from the runner.
    # Every config has a chunk shorter than the prompt, so the runner keeps a hybrid KV cache: the
    # chunked layers attend over tables that start at their chunk (reversed block ids, 32 a group).
    runner = ModelRunner(checkpoint, "float32", CacheConfig(block_size=4, num_blocks=32))
    assert runner.kv_layout.is_hybrid
    step = build_step(runner, [SequenceStep(prompt, 0, list(range(31, 21, -1)), logits_from=0)])
    got = torch.log_softmax(runner.execute(step).logits, dim=-1)
    assert (got - expected).abs().max().item() < 1e-4
    # The same through the public API's prompt_logprobs (top 5 + the actual token per position).
    with LLM(str(checkpoint), dtype="float32") as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert prompt[position] in entry
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[:5] == [1, 2, 3, 4, 5]
        for token, logprob in entry.items():
            assert abs(logprob.logprob - expected[position - 1, token].item()) < 1e-4


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_greedy_generation_matches_transformers(checkpoint, enforce_eager):
    reference = load_reference(checkpoint)
    # One prompt at a time: compiled, only the one-sequence graph is built (max_num_seqs 1).
    with LLM(str(checkpoint), dtype="float32", block_size=4, max_num_seqs=1, enforce_eager=enforce_eager) as llm:
        for seed in (2, 3):
            prompt = _prompt(seed)
            out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))[0]
            assert out.token_ids == reference_greedy(reference, prompt, NEW_TOKENS)
            assert out.finish_reason == "length"


def test_batch_of_mixed_lengths_matches_each_prompt_alone(tmp_path):
    path = make_text_checkpoint(tmp_path / "ckpt", **CONFIGS["moe_every_layer_top1_qknorm_gqa4"])
    prompts = [_prompt(10 + i, length) for i, length in enumerate([3, 17, 40, 9, 1])]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(str(path), dtype="float32", block_size=4) as llm:
        batched = llm.generate(prompts, params)
        alone = [llm.generate([p], params)[0] for p in prompts]
    for b, a in zip(batched, alone, strict=True):
        assert b.token_ids == a.token_ids
        for pos_b, pos_a in zip(b.logprobs, a.logprobs, strict=True):
            assert pos_b.keys() == pos_a.keys()
            assert all(abs(pos_b[t].logprob - pos_a[t].logprob) < 1e-4 for t in pos_b)


def test_transformers_4x_config_spelling_loads_the_same_model(tmp_path):
    """4.x wrote rope_theta + rope_scaling where 5.x writes rope_parameters."""
    path = make_text_checkpoint(tmp_path / "ckpt", **CONFIGS["moe_interleaved_top2_tied_gqa1_llama3"])
    reference = load_reference(path)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    prompt = _prompt(4)
    with LLM(str(path), dtype="float32") as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(reference, prompt, 16)


def test_bfloat16_stays_close_to_float32(tmp_path):
    path = make_text_checkpoint(tmp_path / "ckpt", **CONFIGS["moe_every_layer_top1_qknorm_gqa4"])
    prompt = _prompt(5)
    f32_runner = ModelRunner(path, "float32", CacheConfig(block_size=4, num_blocks=16))
    step = build_step(f32_runner, [SequenceStep(prompt, 0, list(range(10)), logits_from=0)])
    f32 = f32_runner.execute(step).logits
    bf16_runner = ModelRunner(path, "bfloat16", CacheConfig(block_size=4, num_blocks=16))
    assert bf16_runner.kv_caches[0].dtype == torch.bfloat16
    bf16 = bf16_runner.execute(step).logits
    # bf16 keeps 8 mantissa bits: per-op relative error ~4e-3, a few layers deep stays well under 0.25.
    assert (torch.softmax(bf16, -1) - torch.softmax(f32, -1)).abs().max().item() < 0.05
    assert (bf16.argmax(-1) == f32.argmax(-1)).float().mean().item() > 0.9
