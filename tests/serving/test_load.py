"""A small version of `warpspec bench load` (benchmarks/load.py) on the shared stack: 8 streaming
clients, 40 requests of mixed kinds (complete, cancelled mid-stream, 1 ms deadline, bad parameters);
each gets its tokens or its status, no KV block leaks, no actor is orphaned, and greedy outputs of fixed
prompts are the same alone and amid the load, without speculation (over gRPC) and with it (the
bundled pair, in-process). The full load (64 clients, 500 requests, 3 rounds) runs as `warpspec bench load`."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from helpers.waiting import wait_for_async
from warpspec.benchmarks.load import (
    MIX,
    LoadSpec,
    alive_actors,
    greedy_outputs,
    live_placement_groups,
    make_requests,
    run_round,
)

pytestmark = pytest.mark.slow


def test_requests_mix_kinds_and_is_reproducible():
    spec = LoadSpec(num_clients=8, num_requests=200, max_new_tokens=24)
    requests = make_requests(spec, seed=3)
    kinds = {k: sum(1 for kind, _, _ in requests if kind == k) for k in MIX}
    assert all(n > 0 for n in kinds.values()), kinds
    assert [r.SerializeToString() for _, r, _ in requests] == \
        [r.SerializeToString() for _, r, _ in make_requests(spec, seed=3)]
    assert all(1 <= r.params.max_tokens <= 24 for kind, r, _ in requests if kind == "complete")


def test_small_load_over_grpc_loses_nothing_and_leaks_nothing(serving_stack):
    vocab = json.loads((serving_stack.model_path / "config.json").read_text())["vocab_size"]
    spec = LoadSpec(num_clients=8, num_requests=40, max_new_tokens=24, vocab_size=vocab, seed=1)
    prompts = [[5, 6, 7], [100, 200, 300, 400], list(range(10, 60)), [9] * 20]
    actors, groups = alive_actors(), live_placement_groups()

    alone = [asyncio.run(greedy_outputs(serving_stack.grpc_target, [p], 16))[0] for p in prompts]

    async def load_with_prompts_amid():
        amid = asyncio.ensure_future(greedy_outputs(serving_stack.grpc_target, prompts, 16, delay_s=0.5))
        return await run_round(serving_stack.grpc_target, spec, seed=1), await amid

    rnd, amid = asyncio.run(load_with_prompts_amid())
    assert len(rnd.results) == 40
    assert not rnd.failures, [r for r in rnd.failures]
    assert {r.kind for r in rnd.results} == set(MIX)
    assert amid == alone
    stats = serving_stack.wait_idle(timeout_s=20)  # every KV block free again
    assert stats["is_healthy"]
    assert (alive_actors(), live_placement_groups()) == (actors, groups)


def test_speculative_greedy_is_the_same_alone_and_amid_load():
    """The bundled target and EAGLE-3 draft in one AsyncLLM: fixed prompts alone, then again while 16
    other requests of mixed lengths stream through (a quarter of them abandoned mid-stream)."""
    from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
    from warpspec.entrypoints.async_llm import AsyncLLM
    from warpspec.sampling_params import SamplingParams

    prompts = held_out_prompts()[:4]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def main():
        engine = AsyncLLM.from_options(str(BUNDLED_TARGET), draft=str(BUNDLED_DRAFT), dtype="float32",
                                       compile_draft=False, num_kv_blocks=256, max_model_len=512)

        async def run(prompt, params, give_up_after=None) -> list[int]:
            tokens = []
            async for out in engine.generate(prompt, params):
                tokens += out.new_token_ids
                if give_up_after is not None and len(tokens) >= give_up_after:
                    break  # the client went away: AsyncLLM aborts the request
            return tokens

        alone = [await run(p, greedy) for p in prompts]
        rng = random.Random(0)
        load = [run([rng.randrange(3, 8192) for _ in range(rng.choice((4, 40, 120)))],
                    SamplingParams(max_tokens=rng.randint(4, 48), temperature=0.0, ignore_eos=True),
                    give_up_after=2 if i % 4 == 0 else None) for i in range(16)]
        background = asyncio.gather(*load)
        await asyncio.sleep(0.2)
        amid = await asyncio.gather(*[run(p, greedy) for p in prompts])
        await background
        blocks = engine.engine.block_manager  # abandoned requests' aborts are applied between steps
        await wait_for_async(lambda: blocks.num_free_blocks == blocks.num_blocks, 10, "every KV block free")
        assert engine.engine.spec_stats.num_accepted_tokens > 0  # it did speculate
        await engine.shutdown()
        return alone, amid

    alone, amid = asyncio.run(main())
    assert all(len(t) == 24 for t in alone)
    assert amid == alone
