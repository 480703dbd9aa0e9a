"""AsyncLLM: concurrent streams, aborts that free memory, back-pressure, bad requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from warpspec import LLM, InvalidRequestError, SamplingParams
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.errors import EngineOverloadedError, StepFailedError
from warpspec.training.random_checkpoint import create_random_checkpoint

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


def test_a_failed_step_fails_its_requests_and_the_rest_are_served(checkpoint):
    """A step that raises something other than EngineError (a bug, a bad tensor) used to leave its
    requests in the batch: AsyncLLM stepped them again at once, forever, without yielding to the
    event loop. Now that step's requests fail with StepFailedError and the others are served."""
    failures = {"left": 1}

    async def main():
        engine = AsyncLLM.from_options(str(checkpoint), dtype="float32", max_num_seqs=1)
        execute = engine.engine.executor.execute

        def fail_once(step):
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("a bug in the step")
            return execute(step)

        engine.engine.executor.execute = fail_once
        # max_num_seqs=1: the first request runs alone in the failing step, the second waits.
        first = asyncio.create_task(_collect(engine, [1, 2, 3], GREEDY))
        second = asyncio.create_task(_collect(engine, [4, 5, 6], GREEDY))
        with pytest.raises(StepFailedError, match="RuntimeError: a bug in the step"):
            await first
        served = await second
        after = await _collect(engine, [7, 8], GREEDY)
        blocks = engine.engine.block_manager
        assert blocks.num_free_blocks == blocks.num_blocks and not engine.engine.has_unfinished()
        await engine.shutdown()
        return served, after

    outcome: dict = {}
    # A regression spins the event loop without ever yielding, so no asyncio timeout could fire.
    thread = threading.Thread(target=lambda: outcome.update(result=asyncio.run(main())), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the engine loop is stuck on the failed step"
    served, after = outcome["result"]
    assert len(served[-1].token_ids) == 16 and len(after[-1].token_ids) == 16


def test_llm_generate_leaves_nothing_behind_after_a_failed_step(checkpoint):
    with LLM(str(checkpoint), dtype="float32") as llm:
        expected = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
        execute = llm.engine.executor.execute

        def fail(step):
            raise ValueError("a bad tensor")

        llm.engine.executor.execute = fail
        with pytest.raises(StepFailedError, match="ValueError: a bad tensor"):
            llm.generate([[1, 2, 3], [4, 5]], GREEDY)
        assert not llm.engine.has_unfinished()
        llm.engine.executor.execute = execute
        assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == expected


def test_no_blocking_ray_call_runs_on_the_event_loop(ray_cluster, checkpoint, monkeypatch):
    """With Ray workers every step is a ray.get on the coordinator. On the replica's event loop it
    would stall every stream, cancel and health check for the length of each step."""
    import ray

    from warpspec.serving.replica_frontend import ReplicaFrontend

    on_loop: list[str] = []
    blocking_get = ray.get

    def get(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append("".join(__import__("traceback").format_stack(limit=4)))
        except RuntimeError:  # no loop runs in this thread: a worker thread
            pass
        return blocking_get(*args, **kwargs)

    monkeypatch.setattr(ray, "get", get)

    async def main():
        llm = await AsyncLLM.create(str(checkpoint), dtype="float32", num_workers=1, executor="ray")
        engine = ReplicaFrontend(llm, "tiny", rebuild_on_failure=False)
        await engine.warm_up()
        outputs = [out async for out in engine.stream([1, 2, 3], GREEDY)]
        processes = await engine.processes()
        engine.stats()
        await engine.shutdown()
        return outputs, processes

    outputs, processes = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 16
    assert processes.coordinator_pid is not None and len(processes.worker_pids) == 1
    assert not on_loop, on_loop[0]


@pytest.mark.parametrize("interval_ms,new_tokens_per_output", [(0, [1] * 16), (60_000, [1, 15])])
def test_the_core_merges_a_requests_middle_steps_into_one_reply_per_interval(ray_cluster, checkpoint, interval_ms,
                                                                            new_tokens_per_output):
    """Through Ray each streamed reply costs the core ~0.3 ms, so between a request's first token and
    its end the core merges steps into one reply per core_reply_interval_ms. Over 16 plain steps: at
    0, one output per step; at a minute, the first token at once and the other 15 with the end."""
    async def main():
        llm = await AsyncLLM.create(str(checkpoint), dtype="float32", executor="ray",
                                    core_reply_interval_ms=interval_ms)
        try:
            return await _collect(llm, [1, 2, 3], GREEDY)
        finally:
            await llm.shutdown()

    with LLM(str(checkpoint), dtype="float32") as alone:
        expected = alone.generate([[1, 2, 3]], GREEDY)[0].token_ids
    outputs = asyncio.run(main())
    assert [len(out.new_token_ids) for out in outputs] == new_tokens_per_output
    assert [t for out in outputs for t in out.new_token_ids] == outputs[-1].token_ids == expected


def test_step_failed_error_crosses_processes_intact():
    """With Ray workers it is raised in the coordinator and re-raised in the replica (through pickle)."""
    import pickle

    error = StepFailedError.caused_by(["a", "b"], ValueError("bad tensor\nsecond line"))
    again = pickle.loads(pickle.dumps(error))
    assert again.request_ids == ["a", "b"] and str(again) == str(error)
    assert str(error) == "the engine step running this request failed (ValueError: bad tensor)"


def test_requests_cancelled_by_ray_lose_no_message_to_the_engine_core(ray_cluster, checkpoint):
    """Serve cancels a replica's request with ray.cancel, which also cancels every Ray task that
    request submitted and that has not run yet. The replica's fire-and-forget message to the core
    (RayCoreClient.send) once ran in the context of the request that woke it: cancelling a request
    right after it arrived could take the message with it, carrying other requests' adds, and the
    core then waited for that message number forever (seen in `warpspec bench load`: 1 ms deadlines).
    Here an async actor stands in for the replica, and its requests are cancelled as Serve does."""
    import ray

    @ray.remote(num_cpus=0)
    class Front:
        async def start(self, model: str) -> None:
            self.llm = await AsyncLLM.create(model, dtype="float32", num_workers=1, executor="ray")

        @ray.method(num_returns="streaming")
        async def stream(self, prompt: list[int]):
            async for out in self.llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)):
                yield len(out.token_ids)

        async def complete(self, prompt: list[int]) -> int:
            outs = [out async for out in self.llm.generate(prompt, GREEDY)]
            return len(outs[-1].token_ids)

        async def stop(self) -> None:
            await self.llm.shutdown()

    front = Front.remote()
    ray.get(front.start.remote(str(checkpoint)))
    try:
        for i in range(40):
            stream = front.stream.remote([1, 2, 3 + i])
            time.sleep(0.001 * (i % 4))
            ray.cancel(stream)
        # Every message the cancelled requests sent reached the core, so this one is not held back.
        assert ray.get(front.complete.remote([4, 5, 6]), timeout=60) == 16
    finally:
        ray.get(front.stop.remote(), timeout=60)
        ray.kill(front)


def test_the_stall_clock_runs_only_while_requests_are_in_flight(checkpoint):
    """AsyncLLM.stalled_s, what the replica's watchdog reads: 0 while idle however long, counted from
    the first request after idling, and back to 0 on each step delivered."""
    async def main():
        engine = AsyncLLM.from_options(str(checkpoint), dtype="float32")
        engine.last_progress -= 3600  # an hour idle since the last step
        assert engine.stalled_s() == 0.0
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        await stream.__anext__()  # a step was delivered
        stalled_while_running = engine.stalled_s()
        await stream.aclose()
        await engine.shutdown()
        return stalled_while_running, engine.stalled_s()

    running, after = asyncio.run(main())
    assert 0.0 <= running < 60 and after == 0.0
