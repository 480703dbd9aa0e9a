"""AsyncLLM: concurrent streams, aborts that free memory, back-pressure, bad requests."""

from __future__ import annotations

import asyncio

import pytest

from warpspec import LLM, InvalidRequestError, SamplingParams
from warpspec.async_llm import AsyncLLM
from warpspec.errors import EngineOverloadedError
from warpspec.random_checkpoint import create_random_checkpoint

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("async"), "tiny", std=0.3)


async def _collect(llm: AsyncLLM, prompt, params, request_id=None):
    deltas = []
    async for out in llm.generate(prompt, params, request_id):
        deltas.append(out)
    return deltas


def test_concurrent_streams_match_the_blocking_api(checkpoint):
    prompts = ["def f(x):", "import os", "class Foo:", "while True:", "return None"]
    with LLM(str(checkpoint), dtype="float32") as llm:
        expected = llm.generate(prompts, GREEDY)

    async def main():
        engine = AsyncLLM.from_options(str(checkpoint), dtype="float32")
        results = await asyncio.gather(*[_collect(engine, p, GREEDY) for p in prompts])
        await engine.shutdown()
        return results

    for deltas, want in zip(asyncio.run(main()), expected, strict=True):
        final = deltas[-1]
        assert final.finished and final.token_ids == want.token_ids and final.text == want.text
        assert [t for d in deltas for t in d.new_token_ids] == want.token_ids
        assert "".join(d.new_text for d in deltas) == want.text
        assert all(not d.finished for d in deltas[:-1])
        assert final.metrics["completion_tokens"] == 16


def test_closing_a_stream_aborts_and_frees_its_blocks(checkpoint):
    async def main():
        engine = AsyncLLM.from_options(str(checkpoint), dtype="float32", block_size=4)
        manager = engine.engine.block_manager
        stream = engine.generate([1] * 30, SamplingParams(max_tokens=400, ignore_eos=True), "leaver")
        await stream.__anext__()
        assert manager.num_free_blocks < manager.num_blocks
        await stream.aclose()  # the client went away
        survivor = await _collect(engine, [1, 2, 3], GREEDY)  # the next step runs after the abort
        assert "leaver" not in engine.engine.requests
        assert manager.num_free_blocks == manager.num_blocks
        await engine.shutdown()
        return survivor

    assert asyncio.run(main())[-1].finished


def test_full_waiting_queue_refuses_new_requests_at_once(checkpoint):
    async def main():
        engine = AsyncLLM.from_options(str(checkpoint), dtype="float32", max_num_seqs=1, max_waiting_requests=2)
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        tasks = [asyncio.create_task(_collect(engine, [1, 2, 3], long))]
        while not engine.engine.scheduler.running:
            await asyncio.sleep(0.001)
        tasks += [asyncio.create_task(_collect(engine, [1, 2, 3 + i], long)) for i in (1, 2)]
        while engine.engine.num_waiting < 2:  # one running (max_num_seqs=1), two waiting
            await asyncio.sleep(0.001)
        with pytest.raises(EngineOverloadedError, match="2 requests already waiting"):
            await _collect(engine, [9, 9], GREEDY)
        done = await asyncio.gather(*tasks)  # the accepted ones all complete
        await engine.shutdown()
        return done

    assert [len(d[-1].token_ids) for d in asyncio.run(main())] == [200, 200, 200]


def test_bad_requests_fail_alone(checkpoint):
    async def main():
        engine = AsyncLLM.from_options(str(checkpoint), dtype="float32")
        good = asyncio.create_task(_collect(engine, [1, 2, 3], GREEDY, "good"))
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await _collect(engine, [1, 99999], GREEDY)
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await _collect(engine, [1] * 5000, GREEDY)
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError, match="request_id 'good' is already in flight"):
            await _collect(engine, [1, 2], GREEDY, "good")
        result = await good
        await engine.shutdown()
        return result

    assert len(asyncio.run(main())[-1].token_ids) == 16
