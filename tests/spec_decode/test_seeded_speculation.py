"""A seeded request reads the same in any crowd with an EAGLE-3 draft too: prefix-cache hits,
preemption, chunked prefill and a full token budget change neither the draft's state nor the draws.
Under coupled verification it also reads the same as without the draft."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from helpers.eagle3_checkpoints import make_speculation_draft, make_speculation_target
from helpers.staggered import run_staggered
from warpspec import LLM, SamplingParams
from warpspec.entrypoints.async_llm import AsyncLLM

BLOCK = 4
# A crowd engine: 10 blocks of 4 tokens hold far less than the requests need at once (preemption),
# 16 tokens per step (chunked prefill, and verifications that wait for room), prefix caching on. The
# target's hybrid KV cache (chunk 8, 6 KV groups of one layer) needs less of that memory than the full
# one did, whose 20 blocks preempted.
CROWD = dict(block_size=BLOCK, num_kv_blocks=10, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_speculation_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_speculation_draft(tmp_path_factory.mktemp("draft"))


def _requests(seed: int = 0) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(request id, prompt, params, the step it arrives at). Every kind of request: greedy, seeded
    top-p / top-k / min-p, penalties (never drafted), stop tokens; a third share an opening of three
    whole blocks. A cached block is keyed by the token after it too (the draft's KV), so the first
    two serve: their prefix hits end at a block boundary, where a chunk starts (the hybrid cache's
    chunked groups then need nothing; the tiny cache evicts their given-back blocks first)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 160) for _ in range(3 * BLOCK)]
    kinds = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, top_k=20, min_p=0.02, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.7, repetition_penalty=1.3, seed=13, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, seed=14, stop_token_ids=[7, 8, 9, 10], ignore_eos=True),
    ]
    requests = []
    for i in range(12):
        own = [rng.randrange(3, 160) for _ in range(rng.randrange(1, 20))]
        prompt = shared + own if i % 3 == 0 else own
        params = kinds[i % len(kinds)]
        if params.seed is not None:
            params = SamplingParams(**{**vars(params), "seed": params.seed + 100 * i})
        requests.append((f"r{i}", prompt, params, rng.randrange(0, 12)))
    return requests


def _options(speculation: str, draft) -> dict:
    if speculation == "none":
        return {}
    return dict(draft=str(draft), num_speculative_tokens=3, compile_draft=False,
                coupled_verification=speculation == "coupled",
                speculative_policy="adaptive" if speculation == "adaptive" else "fixed")


def _alone(target, draft, speculation: str) -> dict[str, list[int]]:
    """Each request on an engine of its own (one at a time, nothing cached from the others)."""
    with LLM(str(target), dtype="float32", enable_prefix_caching=False, **_options(speculation, draft)) as llm:
        return {rid: llm.generate([prompt], params)[0].token_ids for rid, prompt, params, _ in _requests()}


@pytest.fixture(scope="module")
def alone_without_draft(target):
    return _alone(target, None, "none")


@pytest.fixture(scope="module")
def alone_with_draft(target, draft):
    return _alone(target, draft, "rejection")


@pytest.mark.parametrize("speculation", ["none", "rejection", "coupled", "adaptive"])
def test_staggered_crowd_matches_each_request_alone(target, draft, alone_without_draft, alone_with_draft,
                                                    speculation):
    """Rejection sampling reproduces each request's run alone with the draft; coupled verification
    (and plain decoding) reproduce its run alone without one. Under the adaptive draft length
    (rejection sampling) a seeded request drafts as many as it may whatever the crowd, and reads as
    alone under the fixed one; greedy ones read the same whatever each step drafted."""
    expected = alone_with_draft if speculation in ("rejection", "adaptive") else alone_without_draft
    requests = _requests()
    with LLM(str(target), dtype="float32", **CROWD, **_options(speculation, draft)) as llm:
        engine = llm.engine
        got = {rid: out.token_ids for rid, out in run_staggered(engine, requests).items()}
        assert engine.scheduler.num_preemptions > 0  # the tiny cache did force recomputes
        assert engine.block_manager.stats.hit_tokens > 0  # and the shared opening was reused
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # no leaks
        if speculation != "none":
            stats = engine.spec_stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects both ran
    for rid, _, _, _ in requests:
        assert got[rid] == expected[rid], rid


def test_staggered_crowd_over_two_workers_matches_each_request_alone(ray_cluster, target, draft, alone_with_draft):
    """The same through AsyncLLM with the engine core and draft in the coordinator of 2 Ray workers,
    arrivals staggered in time."""
    requests = _requests()
    delays = random.Random(1)

    async def one(engine: AsyncLLM, prompt, params) -> list[int]:
        await asyncio.sleep(delays.uniform(0, 0.5))
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        return final.token_ids

    async def main():
        engine = AsyncLLM.from_options(str(target), dtype="float32", num_workers=2, **CROWD,
                                       **_options("rejection", draft))
        try:
            return await asyncio.gather(*[one(engine, prompt, params) for _, prompt, params, _ in requests])
        finally:
            await engine.shutdown()

    for (rid, _, _, _), tokens in zip(requests, asyncio.run(main()), strict=True):
        assert tokens == alone_with_draft[rid], rid


def _draft_trace(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams):
    """The drafts, and the distributions they were drawn from, after every step of one request."""
    engine, trace = llm.engine, []
    request = engine.new_request(request_id, prompt, params)
    llm.output_processor.add(request)
    engine.add_request(request)
    while engine.has_unfinished():
        finished = [out for out in llm.output_processor.process(engine.step()) if out.finished]
        seq = engine.requests.get(request_id)
        if seq is not None:
            trace.append((list(seq.draft_token_ids), seq.draft_probs))
    return trace, finished[0]


def test_a_prefix_cache_hit_leaves_the_draft_proposals_unchanged(target, draft):
    """B shares two whole blocks with A and differs right after them. The draft's KV at A's second
    block's last position was computed with A's next token, so B may reuse A's first block only: its
    proposals then equal a cold cache's."""
    opening = list(range(20, 20 + 2 * BLOCK))
    a, b = opening + [50, 51, 52], opening + [60, 61, 62]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    options = dict(dtype="float32", block_size=BLOCK, draft=str(draft), num_speculative_tokens=3, compile_draft=False)
    with LLM(str(target), **options) as llm:
        cold, cold_out = _draft_trace(llm, "b", b, params)
    with LLM(str(target), **options) as llm:
        llm.generate([a], params)
        warm, warm_out = _draft_trace(llm, "b", b, params)
    assert warm_out.metrics["cached_prompt_tokens"] == BLOCK  # the first block was a hit, the second not
    assert warm_out.token_ids == cold_out.token_ids
    assert [drafts for drafts, _ in warm] == [drafts for drafts, _ in cold]
    for (_, warm_probs), (_, cold_probs) in zip(warm, cold, strict=True):
        torch.testing.assert_close(warm_probs, cold_probs)
