"""Under continuous batching every request gets exactly what it gets alone: requests arriving at
random steps, mixed lengths, chunked prefill, preemption forced by a tiny KV cache, prefix hits."""

from __future__ import annotations

import dataclasses
import random

import pytest

from helpers.hf_checkpoints import make_text_checkpoint
from helpers.staggered import run_staggered
from warpspec import LLM, SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("cb"), attention_chunk_size=8, floor_scale=4,
                                interleave_moe_layer_step=2)


def _requests(seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 160) for _ in range(12)]  # a common prefix: prefix cache hits
    requests = []
    for i in range(12):
        own = [rng.randrange(3, 160) for _ in range(rng.randrange(1, 30))]
        prompt = shared + own if i % 3 == 0 else own
        params = SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0, ignore_eos=True)
        if i % 4 == 1:  # seeded sampling must not depend on the batch either
            params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
        requests.append((f"r{i}", prompt, params, rng.randrange(0, 15)))  # arrives at that step
    return requests


@pytest.fixture(scope="module")
def solo_tokens(checkpoint) -> dict[str, list[int]]:
    """Each of _requests() run alone, on the default (hybrid) cache."""
    with LLM(str(checkpoint), dtype="float32", enable_prefix_caching=False) as solo:
        return {rid: solo.generate([prompt], params)[0].token_ids for rid, prompt, params, _ in _requests()}


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "full"])
def test_random_arrivals_match_solo_runs(checkpoint, solo_tokens, hybrid):
    """The solo runs keep the default (hybrid) cache: the crowd on a full cache must match it too."""
    requests, expected = _requests(), solo_tokens
    # 20 blocks of 4 tokens hold ~80 tokens: far less than the requests need at once. (A hybrid cache
    # holds 4 x 20 blocks of one layer in that memory: 1 full and 3 chunked groups.)
    with LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=20,
             max_num_batched_tokens=16, hybrid_kv_cache=hybrid) as llm:
        engine = llm.engine
        assert engine.kv_layout.is_hybrid == hybrid
        got = run_staggered(engine, requests)
        assert engine.scheduler.num_preemptions > 0  # the tiny cache did force recomputes
        assert engine.block_manager.stats.hit_tokens > 0  # and the shared prefix was reused
        assert (engine.block_manager.num_released_blocks > 0) == hybrid  # chunks passed gave blocks back
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # no leaks
        assert not engine.block_manager.block_tables
    for rid, _, params, _ in requests:
        assert got[rid].token_ids == expected[rid], rid
        assert got[rid].finish_reason == "length" and len(got[rid].token_ids) == params.max_tokens


def test_mixed_priorities_reorder_and_preempt_but_change_no_token(checkpoint, solo_tokens):
    """Priorities -1, 0 and 1 in a crowd that a small batch and a tiny cache keep full: better ones
    preempt worse ones, and greedy and seeded requests still get their solo tokens."""
    requests = [(rid, prompt, dataclasses.replace(params, priority=i % 3 - 1), step)
                for i, (rid, prompt, params, step) in enumerate(_requests())]
    with LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=20, max_num_batched_tokens=16,
             max_num_seqs=3, priority_aging_steps=50) as llm:
        engine = llm.engine
        got = run_staggered(engine, requests)
        assert engine.scheduler.num_priority_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # no leaks
    for rid, _, params, _ in requests:
        assert got[rid].token_ids == solo_tokens[rid], rid
        assert len(got[rid].token_ids) == params.max_tokens


def test_prompt_logprobs_survive_chunking_and_preemption(checkpoint):
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2)
    with LLM(str(checkpoint), dtype="float32") as llm:
        expected = llm.generate([prompt], params)[0]
    with LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=8) as llm:
        outs = llm.generate([prompt, list(range(50, 90))], params)
    assert outs[0].token_ids == expected.token_ids
    assert len(outs[0].prompt_logprobs) == len(prompt)
    for got, want in zip(outs[0].prompt_logprobs[1:], expected.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)


def test_metrics_count_cached_prompt_tokens(checkpoint):
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(checkpoint), dtype="float32", block_size=8) as llm:
        first = llm.generate([prompt], params)[0]
        second = llm.generate([prompt], params)[0]
    assert first.metrics["cached_prompt_tokens"] == 0
    assert second.metrics["cached_prompt_tokens"] == 32  # 4 full blocks; the last token is recomputed
    assert second.token_ids == first.token_ids
    for key in ("prompt_tokens", "completion_tokens", "queue_time_s", "time_to_first_token_s",
                "time_per_output_token_s"):
        assert key in second.metrics
    assert second.metrics["prompt_tokens"] == 37 and second.metrics["completion_tokens"] == 4


def test_stats_give_the_blocks_each_kv_group_holds(checkpoint):
    """A 20-token prompt in blocks of 4 with chunk 8: after its prefill every group holds 5 blocks
    but the chunked ones give back blocks 0-3 (positions 0..15, before position 20's chunk)."""
    with LLM(str(checkpoint), dtype="float32", block_size=4, enforce_eager=True) as llm:
        core = llm.engine
        core.add_request(core.new_request("a", list(range(3, 23)), SamplingParams(max_tokens=4, temperature=0)))
        core.step()
        stats = core.stats()
        assert stats.kv_blocks_by_group == (("full attention", 5), ("chunked attention (8)", 1),
                                            ("chunked attention (8)", 1), ("chunked attention (8)", 1))
        assert stats.num_released_kv_blocks == 3 * 4
        assert stats.num_free_kv_blocks == stats.num_kv_blocks - 8
