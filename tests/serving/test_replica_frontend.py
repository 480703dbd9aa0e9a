"""ReplicaFrontend and GenerationService in-process (no Ray, no network): the paths a network test
cannot trigger on demand - a full queue, a worker dying mid-request - and their wire statuses."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.errors import EngineError, EngineOverloadedError, WorkerDiedError
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.serving.grpc_service import GenerationService
from warpspec.serving.replica_frontend import ReplicaFrontend
from warpspec.serving.wire_errors import wire_error


def _engine(checkpoint, **options) -> ReplicaFrontend:
    llm = AsyncLLM.from_options(str(checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=32, **options)
    return ReplicaFrontend(llm, "tiny")


def _request(max_tokens=4) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="def main():", params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_full_queue_is_resource_exhausted(serving_checkpoint):
    async def main():
        service = GenerationService(_engine(serving_checkpoint, max_waiting_requests=1))
        # Both are submitted before the engine loop runs: the second finds the queue full.
        results = await asyncio.gather(service.generate(_request()), service.generate(_request()),
                                       return_exceptions=True)
        assert isinstance(results[0], pb.GenerateResponse) and results[0].usage.completion_tokens == 4
        assert isinstance(results[1], EngineOverloadedError)
        wire = wire_error(results[1])
        assert (wire.grpc_code, wire.http_status) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)
        assert "max_waiting_requests" in wire.message
        stats = service.frontend.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.is_healthy
        await service.frontend.shutdown()

    asyncio.run(main())


def test_dead_worker_makes_the_replica_unavailable_and_unhealthy(serving_checkpoint):
    async def main():
        engine = _engine(serving_checkpoint)
        service = GenerationService(engine)
        assert service.health_check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING

        def die(step):
            raise WorkerDiedError("a worker of this replica died during a step: test")

        engine.llm.engine.executor.execute = die
        with pytest.raises(WorkerDiedError) as error:
            await service.generate(_request())
        assert wire_error(error.value).grpc_code == grpc.StatusCode.UNAVAILABLE

        assert service.health_check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(EngineError):
            engine.check_health()  # what Serve's health check calls: the replica gets replaced
        with pytest.raises(EngineError, match="cannot serve"):  # later requests fail fast
            await service.generate(_request())
        assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
        await engine.shutdown()

    asyncio.run(main())


def test_readiness_fails_while_draining_or_down_and_liveness_only_when_it_cannot_recover(serving_checkpoint):
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    ready, live = health_pb2.HealthCheckRequest(), health_pb2.HealthCheckRequest(service="liveness")

    async def main():
        llm = AsyncLLM.from_options(str(serving_checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=32)
        draining = GenerationService(ReplicaFrontend(llm, "tiny"))
        await draining.frontend.drain(0.0)
        assert (draining.health_check(ready).status, draining.health_check(live).status) == (not_serving, serving)

        service = GenerationService(ReplicaFrontend(llm, "tiny", rebuild_on_failure=False))
        assert (service.health_check(ready).status, service.health_check(live).status) == (serving, serving)

        def die(step):
            raise WorkerDiedError("a worker of this replica died during a step: test")

        llm.engine.executor.execute = die
        with pytest.raises(WorkerDiedError):
            await service.generate(_request())
        assert (service.health_check(ready).status, service.health_check(live).status) == (not_serving, not_serving)
        with pytest.raises(EngineError, match="down and not rebuilding: a worker of this replica died"):
            service.frontend.check_alive()
        await service.frontend.shutdown()

    asyncio.run(main())


def test_unexpected_errors_never_carry_a_traceback():
    try:
        raise KeyError("boom\nTraceback (most recent call last): secret")
    except KeyError as e:
        wire = wire_error(e)
    assert wire.grpc_code == grpc.StatusCode.INTERNAL and "\n" not in wire.message and "KeyError" in wire.message


def test_stream_interval_bunches_deltas_without_changing_them(serving_checkpoint):
    async def main():
        from warpspec.sampling_params import SamplingParams

        engine = ReplicaFrontend(AsyncLLM.from_options(str(serving_checkpoint), dtype="float32", max_model_len=128,
                                                     num_kv_blocks=32), "tiny", stream_interval=3)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        outs = [out async for out in engine.stream("def main():", params)]
        # The first token at once, then bunches of 3; the last one carries the rest.
        assert [len(o.new_token_ids) for o in outs] == [1, 3, 3, 3]
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
        assert "".join(o.new_text for o in outs) == outs[-1].text
        await engine.shutdown()

    asyncio.run(main())


def test_stream_gap_coalesces_a_fast_stream_and_lets_a_slow_one_through(serving_checkpoint):
    """A gap of 200 ms over 40 tokens made in well under a second: the first token at once, then
    a message per gap at most, each with everything since the last, the tokens and text unchanged.
    With a gap shorter than a step (0.1 ms) each step's token goes out as it comes (tokens of steps
    that queued up while a message was being handed on go together)."""
    async def main():
        import time

        from warpspec.sampling_params import SamplingParams

        engine = ReplicaFrontend(AsyncLLM.from_options(str(serving_checkpoint), dtype="float32", max_model_len=128,
                                                     num_kv_blocks=32), "tiny", stream_gap_s=0.2)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        start, outs, arrivals = time.perf_counter(), [], []
        async for out in engine.stream("def main():", params):
            outs.append(out)
            arrivals.append(time.perf_counter() - start)
        elapsed = arrivals[-1]
        assert len(outs[0].new_token_ids) == 1  # the first token alone, at once
        assert len(outs) <= elapsed / 0.2 + 2  # one per gap, plus the first and the last
        assert len(outs) < 40
        assert all(b - a >= 0.19 for a, b in zip(arrivals[1:-1], arrivals[2:-1], strict=False))
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
        assert "".join(o.new_text for o in outs) == outs[-1].text
        engine.stream_gap_s = 0.0001
        sizes = [len(o.new_token_ids) async for o in engine.stream("def main():", params)]
        assert sum(sizes) == 40 and len(sizes) >= 20  # a message per step, but for steps that queued up
        await engine.shutdown()

    asyncio.run(main())


def test_a_late_reader_gets_the_logprobs_of_its_own_tokens():
    """In one process the engine keeps appending to the list an output's logprobs refer to: a reader
    a step late must still get the positions of that output's new tokens, not the latest ones."""
    from warpspec.outputs import Logprob, RequestOutput, new_positions

    shared = [{5: Logprob(-0.1, 1)}, {7: Logprob(-0.2, 1)}]
    out = RequestOutput("r", None, [1], "", [5, 7], None, logprobs=shared, new_token_ids=[7])
    shared.append({9: Logprob(-0.3, 1)})  # the next step, before the reader got to `out`
    assert new_positions(out) == [{7: Logprob(-0.2, 1)}]
