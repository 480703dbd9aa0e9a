"""Deterministic mode in bf16: a request's tokens depend neither on the crowd it runs in (staggered
arrivals, chunked prefill beside decodes, preemption) nor on speculation, over 1 and 2 workers.

The checkpoint is drawn with a narrow init (0.02): its logits are flat, so near-ties are common and
a single bf16 rounding that depended on the batch would show up as a changed greedy token."""

from __future__ import annotations

import asyncio
import random

import pytest

from helpers.eagle3_checkpoints import make_speculation_draft
from helpers.hf_checkpoints import make_text_checkpoint
from helpers.staggered import run_staggered
from warpspec import LLM, SamplingParams
from warpspec.entrypoints.async_llm import AsyncLLM

BLOCK = 4
# 10 blocks of 4 tokens: far less than the requests need at once (preemption); 16 tokens per step
# (prefill chunks beside decodes and verifications). The target's hybrid KV cache (chunk 8, 6 KV
# groups of one layer) needs less of that memory than the full one did, whose 20 blocks preempted.
CROWD = dict(block_size=BLOCK, num_kv_blocks=10, max_num_batched_tokens=16)
BF16 = dict(dtype="bfloat16", deterministic=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("target"), num_hidden_layers=6, attention_chunk_size=8,
                                floor_scale=4, interleave_moe_layer_step=2, initializer_range=0.02)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_speculation_draft(tmp_path_factory.mktemp("draft"))


def _requests(seed: int = 0) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(request id, prompt, params, the step it arrives at): greedy, and seeded top-p sampling; a
    third share an opening of three whole blocks (prefix-cache hits). With the draft a cached block
    is keyed by the token after it too, so the first two serve: a hit resumes at 8, where a chunk
    starts, and needs nothing from the hybrid cache's chunked groups (whose given-back blocks the
    tiny cache evicts first)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 160) for _ in range(3 * BLOCK)]
    requests = []
    for i in range(10):
        own = [rng.randrange(3, 160) for _ in range(rng.randrange(1, 24))]
        prompt = shared + own if i % 3 == 0 else own
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) if i % 2 == 0 else \
            SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
        requests.append((f"r{i}", prompt, params, rng.randrange(0, 10)))
    return requests


def _options(draft) -> dict:
    return {} if draft is None else dict(draft=str(draft), num_speculative_tokens=3, compile_draft=False)


def _alone(target, draft=None) -> dict[str, list[int]]:
    with LLM(str(target), enable_prefix_caching=False, **BF16, **_options(draft)) as llm:
        return {rid: llm.generate([prompt], params)[0].token_ids for rid, prompt, params, _ in _requests()}


@pytest.fixture(scope="module")
def alone(target):
    return _alone(target)


@pytest.fixture(scope="module")
def alone_with_draft(target, draft):
    return _alone(target, draft)


@pytest.mark.parametrize("with_draft", [False, True])
def test_bf16_crowd_matches_each_request_alone(target, draft, alone, alone_with_draft, with_draft):
    requests = _requests()
    with LLM(str(target), **BF16, **CROWD, **_options(draft if with_draft else None)) as llm:
        got = {rid: out.token_ids for rid, out in run_staggered(llm.engine, requests).items()}
        assert llm.engine.scheduler.num_preemptions > 0  # the tiny cache did force recomputes
        assert llm.engine.block_manager.stats.hit_tokens > 0  # and the shared opening was reused
    expected = alone_with_draft if with_draft else alone
    for rid, _, _, _ in requests:
        assert got[rid] == expected[rid], rid


def test_bf16_greedy_is_the_same_with_and_without_the_draft(target, draft, alone, alone_with_draft):
    """Verification computes each of its k+1 positions to the bits a single-position decode gets, so
    the draft changes how fast greedy tokens come, never which."""
    greedy = [rid for rid, _, params, _ in _requests() if params.temperature == 0]
    assert all(alone_with_draft[rid] == alone[rid] for rid in greedy)


def test_bf16_crowd_over_two_workers_matches_each_request_alone(ray_cluster, target, draft):
    """Through AsyncLLM over 2 Ray workers (the all-reduce between them included) with the draft:
    each request alone, then all of them arriving staggered in time, on the same engine. (Two ranks
    add up partial products that one rank adds in one go, so the reference is 2 workers alone.)"""
    requests, delays = _requests(), random.Random(1)

    async def one(engine: AsyncLLM, prompt, params, delay_s: float) -> list[int]:
        await asyncio.sleep(delay_s)
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        return final.token_ids

    async def main():
        engine = AsyncLLM.from_options(str(target), num_workers=2, **BF16, **CROWD, **_options(draft))
        try:
            alone = [await one(engine, prompt, params, 0) for _, prompt, params, _ in requests]
            crowd = await asyncio.gather(*[one(engine, prompt, params, delays.uniform(0, 0.5))
                                           for _, prompt, params, _ in requests])
            return alone, crowd
        finally:
            await engine.shutdown()

    alone, crowd = asyncio.run(main())
    for (rid, *_), expected, got in zip(requests, alone, crowd, strict=True):
        assert got == expected, rid


def test_deterministic_must_be_a_bool(target):
    with pytest.raises(ValueError, match="deterministic must be true or false"):
        LLM(str(target), deterministic="yes")
