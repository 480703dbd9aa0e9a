"""A seeded request reads the same in any crowd with an EAGLE-3 draft too, under either draft-length
policy: prefix-cache hits, preemption, chunked prefill and a full token budget change neither the
draft's state nor the draws. Under coupled verification it also reads the same as without the draft."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from helpers.eagle3_checkpoints import make_speculation_draft, make_speculation_target
from helpers.staggered import count_unfinished_chunks, run_staggered
from warpspec import LLM, SamplingParams
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.spec_decode.draft_length import MIN_OBSERVED

BLOCK = 4
# A crowd engine: 36 blocks of 4 tokens hold far less than 40 requests need at once (preemption), 32
# tokens per step (chunked prefill, and verifications that wait for room), prefix caching on, 8
# sequences at most (a better priority preempts when the batch is full). 36 blocks also hold the
# stand-ins the adaptive draft length times its steps with at start-up (a backlog of 128 positions and
# 7 more): in a smaller cache it has no step costs, and drafts k at every step. With 16 tokens per
# step, four verifications filled a step and no request was preempted.
CROWD = dict(block_size=BLOCK, num_kv_blocks=36, max_num_batched_tokens=32, max_num_seqs=8)
NUM_REQUESTS = 46  # 40 greedy or seeded, whose tokens are compared, and 6 unseeded beside them
# Speculation settings of the crowd and of the runs alone; "default" is the adaptive draft length.
SPECULATION = {"none": None, "default": {}, "fixed": dict(speculative_policy="fixed"),
               "coupled": dict(coupled_verification=True), "deterministic": dict(deterministic=True)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_speculation_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_speculation_draft(tmp_path_factory.mktemp("draft"))


def _requests(seed: int = 0) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(request id, prompt, params, the step it arrives at). Every kind of request, each with and
    without the shared opening (7 kinds, every second request has it): greedy, seeded top-p / top-k / min-p,
    stop tokens; penalties and opted out, which never draft (under the adaptive draft length the draft
    reads their decoded positions late, from a backlog); unseeded samples, which draft what the policy
    chooses, so their tokens depend on the crowd and are not compared. The opening is three whole
    blocks; a cached block is keyed by the token after it too (the draft's KV), so the first two
    serve. The first request, at step 0, has penalties and a prompt of one step: the blocks the others
    hit are those of a request that never drafts. Priorities -1, 0 and 1 in turn: a better request
    preempts worse ones (alone, a priority changes nothing)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 160) for _ in range(3 * BLOCK)]
    kinds = [
        SamplingParams(max_tokens=24, temperature=0.7, repetition_penalty=1.3, seed=13, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=20, min_p=0.02, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=28, temperature=1.0, seed=14, stop_token_ids=[7, 8, 9, 10], ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=15, speculation=False, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True),
    ]
    requests = []
    for i in range(NUM_REQUESTS):
        own = [rng.randrange(3, 160) for _ in range(rng.randrange(1, 5 if i == 0 else 20))]
        prompt = shared + own if i % 2 == 0 else own
        params = kinds[i % len(kinds)]
        seed = None if params.seed is None else params.seed + 100 * i
        params = SamplingParams(**{**vars(params), "seed": seed, "priority": i % 3 - 1})
        requests.append((f"r{i}", prompt, params, 0 if i == 0 else rng.randrange(1, 8)))
    return requests


def _promised(params: SamplingParams) -> bool:
    """Greedy and seeded requests read the same in any crowd; unseeded samples need not."""
    return params.is_greedy or params.seed is not None


def _options(speculation: str, draft) -> dict:
    options = SPECULATION[speculation]
    if options is None:
        return {}
    return dict(draft=str(draft), num_speculative_tokens=3, compile_draft=False, **options)


def _alone(target, draft, speculation: str) -> dict[str, list[int]]:
    """Each promised request on an engine of its own (one at a time, nothing cached from the others)."""
    with LLM(str(target), dtype="float32", enable_prefix_caching=False, **_options(speculation, draft)) as llm:
        return {rid: llm.generate([prompt], params)[0].token_ids
                for rid, prompt, params, _ in _requests() if _promised(params)}


@pytest.fixture(scope="module")
def alone_without_draft(target):
    return _alone(target, None, "none")


@pytest.fixture(scope="module")
def alone_with_draft(target, draft):
    return _alone(target, draft, "default")


@pytest.fixture(scope="module")
def alone_deterministic(target, draft):
    return _alone(target, draft, "deterministic")


@pytest.mark.parametrize("speculation", list(SPECULATION))
def test_staggered_crowd_matches_each_request_alone(request, target, draft, speculation):
    """Rejection sampling reproduces each request's run alone with the draft, under the adaptive draft
    length (the default) and the fixed one alike: a seeded request drafts as many as it may whatever
    the crowd, and greedy ones read the same whatever each step drafted. Coupled verification (and
    plain decoding) reproduce its run alone without one. In deterministic mode, its run alone in that
    mode."""
    expected = request.getfixturevalue({"none": "alone_without_draft", "coupled": "alone_without_draft",
                                        "deterministic": "alone_deterministic"}.get(speculation, "alone_with_draft"))
    requests = _requests()
    with LLM(str(target), dtype="float32", **CROWD, **_options(speculation, draft)) as llm:
        engine = llm.engine
        num_chunks = count_unfinished_chunks(engine)
        got = {rid: out.token_ids for rid, out in run_staggered(engine, requests).items()}
        assert num_chunks[0] > 0  # prompts were cut by the token budget
        assert engine.scheduler.num_preemptions > 0  # the tiny cache did force recomputes
        assert engine.scheduler.num_priority_preemptions > 0  # some for a better priority
        assert engine.block_manager.stats.hit_tokens > 0  # and the shared opening was reused
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # no leaks
        if speculation != "none":
            stats = engine.spec_stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects both ran
        if speculation not in ("none", "fixed"):
            policy = engine.draft_lengths
            # The adaptive policy had its step costs and left its warm-up: it chose the lengths.
            assert engine.step_costs.rows() and policy.num_observed >= MIN_OBSERVED
            assert sum(policy.num_chosen.values()) > 0
    assert len(expected) == 40 and sorted(expected) == sorted(rid for rid, _, params, _ in requests
                                                              if _promised(params))
    for rid in expected:
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
                                       **_options("default", draft))
        try:
            return await asyncio.gather(*[one(engine, prompt, params) for _, prompt, params, _ in requests])
        finally:
            await engine.shutdown()

    for (rid, _, params, _), tokens in zip(requests, asyncio.run(main()), strict=True):
        if _promised(params):
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


def _spec_options(draft, speculation: str = "default") -> dict:
    """One request at a time: the crowd's speculation settings, float32, blocks of BLOCK."""
    return dict(dtype="float32", block_size=BLOCK, **_options(speculation, draft))


def _assert_same_drafts(warm, cold) -> None:
    assert [drafts for drafts, _ in warm] == [drafts for drafts, _ in cold]
    for (_, warm_probs), (_, cold_probs) in zip(warm, cold, strict=True):
        torch.testing.assert_close(warm_probs, cold_probs)


# A drafts every step (seeded), or never (penalties): under the adaptive draft length the draft reads
# a never-drafting request's decoded positions late, from a backlog, but its prompt at once.
@pytest.mark.parametrize("a_params", [
    SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, seed=3, ignore_eos=True),
], ids=["a-drafts", "a-never-drafts"])
def test_a_prefix_cache_hit_leaves_the_draft_proposals_unchanged(target, draft, a_params):
    """B shares two whole blocks with A and differs right after them. The draft's KV at A's second
    block's last position was computed with A's next token, so B may reuse A's first block only: its
    proposals then equal a cold cache's."""
    opening = list(range(20, 20 + 2 * BLOCK))
    a, b = opening + [50, 51, 52], opening + [60, 61, 62]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    with LLM(str(target), **_spec_options(draft)) as llm:
        cold, cold_out = _draft_trace(llm, "b", b, params)
    with LLM(str(target), **_spec_options(draft)) as llm:
        llm.generate([a], a_params)
        warm, warm_out = _draft_trace(llm, "b", b, params)
    assert warm_out.metrics["cached_prompt_tokens"] == BLOCK  # the first block was a hit, the second not
    assert warm_out.token_ids == cold_out.token_ids
    _assert_same_drafts(warm, cold)


@pytest.mark.parametrize("speculation", ["default", "fixed"])
def test_a_next_turn_hits_only_blocks_the_draft_has_read(target, draft, speculation):
    """A conversation's next turn B sends A's prompt and output back with more. The target's KV of A's
    last step is cached, but the draft never reads a finished request's last step, nor (adaptive, the
    default) a never-drafting request's backlog: B hits only blocks that hold the draft's KV too, and
    its proposals equal a cold cache's. A's 9 + 12 tokens: its last step computes position 19, the
    last of block 4, whose next token (A's last) is known."""
    a_params = SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, seed=3, ignore_eos=True)
    a = list(range(20, 20 + 2 * BLOCK + 1))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    with LLM(str(target), **_spec_options(draft, speculation)) as llm:
        a_out = llm.generate([a], a_params)[0]
        b = a + a_out.token_ids + [60, 61, 62]
        warm, warm_out = _draft_trace(llm, "b", b, params)
    with LLM(str(target), **_spec_options(draft, speculation)) as llm:
        cold, cold_out = _draft_trace(llm, "b", b, params)
    assert warm_out.metrics["cached_prompt_tokens"] >= 2 * BLOCK  # A's prompt, read by the draft at once
    assert warm_out.token_ids == cold_out.token_ids
    _assert_same_drafts(warm, cold)
