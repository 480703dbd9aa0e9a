"""Faults with real process kills, on a replica sharded over Ray actors (a coordinator and 2 workers)
deployed beside the shared stack: a SIGKILLed worker or coordinator fails the streams in flight with
UNAVAILABLE within seconds, the replica reports unhealthy while it rebuilds, then serves the same
tokens as before with as many actors, placement groups and replica memory as before. Scale-down
finishes what it can, cuts off the rest, and releases every actor and placement group."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from conftest import ENGINE_ARGS
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.grpc_stream import Stream
from helpers.waiting import wait_for, wait_for_async
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.errors import ReplicaDrainingError
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc
from warpspec.sampling_params import SamplingParams
from warpspec.serving.replica_frontend import ReplicaFrontend
from warpspec.serving.serve_config import ServeConfig
from warpspec.serving.wire_errors import wire_error

pytestmark = pytest.mark.slow

FAULT_APP = "faults"
# Room for three 1,000-token requests: one outlives the drain timeout below.
SHARDED_ARGS = {**ENGINE_ARGS, "num_workers": 2, "max_model_len": 1024, "num_kv_blocks": 200}
# The fault app's stall watchdog: far above a step here (milliseconds), short enough for a test.
STALL_S = 8.0


def _alive_actors() -> int:
    from warpspec.executor.ray_env import live_actors

    return len(live_actors())


def _live_placement_groups() -> int:
    import ray

    return sum(1 for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED")


def _deploy(name: str, checkpoint, **args):
    """build_app's application (as `warpspec serve` deploys it), beside the shared stack's."""
    from ray import serve

    from warpspec.serving.app import build_app

    app = build_app({"model": str(checkpoint), "model_name": "tiny", **SHARDED_ARGS, **args})
    return serve.run(app, name=name, route_prefix=f"/{name}")


@pytest.fixture(scope="module")
def fault_app(serving_stack):
    from ray import serve

    baseline = (_alive_actors(), _live_placement_groups())
    handle = _deploy(FAULT_APP, serving_stack.model_path, stall_timeout_s=STALL_S)
    with grpc.insecure_channel(serving_stack.grpc_target) as channel:
        yield handle, channel, serving_stack.http_base
    serve.delete(FAULT_APP)
    # Deleting the app released the replica, its coordinator, its workers and their placement group.
    wait_for(lambda: (_alive_actors(), _live_placement_groups()) == baseline, 30, f"back to {baseline}")


def _metadata(app: str) -> list[tuple[str, str]]:
    return [("application", app)]


def _greedy(stub, app: str, max_tokens: int = 16) -> list[int]:
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                 params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return list(stub.Generate(request, timeout=60, metadata=_metadata(app)).token_ids)


def _health(health, app: str) -> int | None:
    """The app's health status; None while a check outlasts its 10 s (a replica rebuilding on busy
    cores answers late, and the wait around it decides how late is too late)."""
    try:
        return health.Check(health_pb2.HealthCheckRequest(), timeout=10, metadata=_metadata(app)).status
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        return None


# Serve replaces a replica after REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD (3) failed health checks in a
# row, one every health_check_period_s, and only a passing check resets the count: the checks that
# failed while one test's replica rebuilt count towards the next test's fault when it comes before
# Serve has checked the rebuilt replica (the likely cause of a replacement seen once in a fresh clone's
# suite: the stuck coordinator right after the two kills, its replica replaced instead of rebuilt).
# Each fault waits for that check.
REBUILT_AT: list[float] = []  # when a test saw its replica serve again


def _after_serve_checked_the_last_rebuild() -> None:
    if REBUILT_AT:
        checked_by = REBUILT_AT[-1] + 1.1 * ServeConfig.health_check_period_s + 0.5  # Serve jitters by 10%
        time.sleep(max(0.0, checked_by - time.monotonic()))


def _stream(stub, app: str, max_tokens: int) -> Stream:
    """A greedy stream of the app's, in a thread once started."""
    return Stream(stub, max_tokens, prompt=[1, 2, 3], metadata=_metadata(app), timeout_s=120)


@pytest.mark.parametrize("victim", ["worker", "coordinator"])
def test_killed_process_fails_in_flight_requests_and_the_replica_rebuilds(fault_app, victim):
    handle, channel, http_base = fault_app
    stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
    expected = _greedy(stub, FAULT_APP)
    before = handle.processes.remote().result()
    actors_before, groups_before = _alive_actors(), _live_placement_groups()
    rss_before = psutil.Process(before.pid).memory_info().rss
    assert len(before.worker_pids) == 2 and before.coordinator_pid is not None

    _after_serve_checked_the_last_rebuild()
    streams = [_stream(stub, FAULT_APP, max_tokens=1000) for _ in range(3)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60) and s.code is None, "the stream did not start"
    pid = before.worker_pids[1] if victim == "worker" else before.coordinator_pid
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for s in streams:
        s.join(timeout=15)
        assert not s.is_alive(), "a stream hung after the kill"
        assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
        assert s.ended_at - killed_at < 10
        assert "died" in s.details and "Traceback" not in s.details

    # Unhealthy while it rebuilds (the gRPC health service and Serve's own check agree), and new
    # requests are refused at once (UNAVAILABLE, HTTP 503); then healthy.
    check = health_pb2.HealthCheckRequest()
    assert health.Check(check, timeout=10, metadata=_metadata(FAULT_APP)).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(Exception, match="cannot serve"):
        handle.check_health.remote().result()
    with pytest.raises(grpc.RpcError) as refused:
        _greedy(stub, FAULT_APP)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "rebuilding" in refused.value.details()
    body = json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{http_base}/{FAULT_APP}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_refused:
        urllib.request.urlopen(request, timeout=10)
    assert http_refused.value.code == 503
    wait_for(lambda: _health(health, FAULT_APP) == health_pb2.HealthCheckResponse.SERVING, 90,
             "the replica to serve again")
    REBUILT_AT.append(time.monotonic())

    after = handle.processes.remote().result()
    assert after.pid == before.pid, "Serve replaced the replica instead of it rebuilding"
    assert after.num_rebuilds == before.num_rebuilds + 1
    assert after.coordinator_pid != before.coordinator_pid and not set(after.worker_pids) & set(before.worker_pids)
    assert _greedy(stub, FAULT_APP) == expected
    # Nothing doubled: the dead coordinator's or survivors' actors and placement group are gone.
    wait_for(lambda: (_alive_actors(), _live_placement_groups()) == (actors_before, groups_before), 20,
              f"{actors_before} actors and {groups_before} placement groups")
    rss_after = psutil.Process(after.pid).memory_info().rss
    assert abs(rss_after - rss_before) < 0.10 * rss_before, (rss_before, rss_after)


def test_a_stuck_coordinator_fails_its_requests_and_the_replica_rebuilds(fault_app):
    """A coordinator that is alive but answers nothing (SIGSTOP: as a hung collective would leave it)
    raises no error anywhere; the watchdog (stall_timeout_s) ends its streams with UNAVAILABLE, the
    replica reports NOT_SERVING and rebuilds, then serves the same tokens."""
    handle, channel, _ = fault_app
    stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
    expected = _greedy(stub, FAULT_APP)
    before = handle.processes.remote().result()
    _after_serve_checked_the_last_rebuild()
    streams = [_stream(stub, FAULT_APP, max_tokens=1000) for _ in range(2)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60) and s.code is None, "the stream did not start"
    os.kill(before.coordinator_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        for s in streams:
            s.join(timeout=STALL_S + 20)
            assert not s.is_alive(), "a stream hung on the stuck coordinator"
            assert s.code == grpc.StatusCode.UNAVAILABLE and "stuck" in s.details, (s.code, s.details)
            assert STALL_S <= s.ended_at - stopped_at < STALL_S + 10
        check = health_pb2.HealthCheckRequest()
        assert health.Check(check, timeout=10, metadata=_metadata(FAULT_APP)).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        # Rebuilt in place, as for a dead coordinator: the stuck one is killed without a shutdown call
        # it could never answer (waiting out that call's 30 s, Serve's health checks replaced the replica).
        wait_for(lambda: _health(health, FAULT_APP) == health_pb2.HealthCheckResponse.SERVING, 120,
                 "the replica to serve again")
        REBUILT_AT.append(time.monotonic())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before.coordinator_pid, signal.SIGKILL)
    after = handle.processes.remote().result()
    assert after.pid == before.pid and after.num_rebuilds == before.num_rebuilds + 1
    assert after.coordinator_pid != before.coordinator_pid
    assert _greedy(stub, FAULT_APP) == expected


def test_scale_down_finishes_short_requests_cuts_off_long_ones_and_releases_everything(serving_stack):
    from ray import serve

    app = "drain"
    baseline = (_alive_actors(), _live_placement_groups())
    drain_s = 3.0  # requests in flight may run this long once scale-down starts
    _deploy(app, serving_stack.model_path, drain_timeout_s=drain_s)
    try:
        assert _live_placement_groups() == baseline[1] + 1
    except AssertionError:
        serve.delete(app)  # no app left behind for the modules after this one
        raise
    with grpc.insecure_channel(serving_stack.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        short = [_stream(stub, app, max_tokens=40) for _ in range(2)]
        long = _stream(stub, app, max_tokens=1000)
        for s in [*short, long]:
            s.start()
        for s in [*short, long]:
            assert s.started.wait(60) and s.code is None
        deleting_at = time.monotonic()
        serve.delete(app)
        for s in [*short, long]:
            s.join(timeout=30)
            assert not s.is_alive(), "a stream hung through scale-down"
    assert all(s.code == grpc.StatusCode.OK and s.num_tokens == 40 for s in short), \
        [(s.code, s.num_tokens) for s in short]
    # Serve gives a replica no notice before it stops it at the drain timeout: the proxy answers the
    # cut-off stream itself (its INTERNAL "actor died" made UNAVAILABLE by grpc_servicers.py), or the
    # replica's drain got to it first (UNAVAILABLE too).
    assert long.code == grpc.StatusCode.UNAVAILABLE, (long.code, long.details)
    assert long.num_tokens < 1000
    assert long.ended_at - deleting_at < drain_s + 10
    wait_for(lambda: (_alive_actors(), _live_placement_groups()) == baseline, 30,
              f"the replica's actors and placement group released ({baseline})")


def test_drain_finishes_in_flight_work_then_cuts_off_the_rest_and_refuses_new(serving_checkpoint):
    """ReplicaFrontend.drain in-process: what a replica's __del__ does with requests still in flight."""

    async def main():
        engine = ReplicaFrontend(AsyncLLM.from_options(str(serving_checkpoint), dtype="float32", max_model_len=512,
                                                     num_kv_blocks=64), "tiny")

        async def run(max_tokens: int):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            try:
                return [t async for out in engine.stream([1, 2, 3], params) for t in out.new_token_ids]
            except Exception as e:  # noqa: BLE001 - the test inspects what came out
                return e

        tasks = [asyncio.create_task(run(8)), asyncio.create_task(run(500))]
        # Drain once both run. A fixed 0.3 s sleep plus a 1 s drain let the 500-token request finish
        # (seen once). From here it needs ~490 more steps (~1.4 s here, 2.8 ms a step), the short one
        # under 8 (~25 ms): 0.25 s leaves 10x either way.
        await wait_for_async(lambda: engine.stats().num_running == 2, 10, "both requests running")
        drain = asyncio.create_task(engine.drain(timeout_s=0.25))
        await asyncio.sleep(0)
        refused = await run(4)  # arrives while draining
        num_cut = await drain
        short, long = await asyncio.gather(*tasks)
        assert isinstance(refused, ReplicaDrainingError)
        assert wire_error(refused).grpc_code == grpc.StatusCode.UNAVAILABLE
        assert len(short) == 8
        assert isinstance(long, ReplicaDrainingError) and "drain timeout 0.25 s" in str(long)
        assert num_cut == 1
        # The cut request's abort is applied by the engine's loop task between steps.
        await wait_for_async(lambda: engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks, 10,
                             "the cut request's KV blocks freed")
        assert engine.stats().num_in_flight == 0
        assert engine.failure is None  # draining is not a fault: nothing to rebuild
        await engine.shutdown()

    asyncio.run(main())


def test_failed_step_rebuilds_the_engine_in_process(serving_checkpoint):
    """The rebuild path without Ray: a step that fails fatally (as when a worker dies) fails every
    request in flight, the replica is unhealthy until a fresh engine is built, then serves the same tokens."""
    from warpspec.errors import EngineError, WorkerDiedError

    async def main():
        engine = ReplicaFrontend(AsyncLLM.from_options(str(serving_checkpoint), dtype="float32", max_model_len=512,
                                                     num_kv_blocks=64), "tiny")
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

        async def run(prompt):
            try:
                return [t async for out in engine.stream(prompt, params) for t in out.new_token_ids]
            except Exception as e:  # noqa: BLE001 - the test inspects what came out
                return e

        expected = await run([5, 6, 7])
        failed_engine = engine.llm.engine

        def die(step):
            raise WorkerDiedError("a worker of this replica died during a step: test")

        failed_engine.executor.execute = die
        results = await asyncio.gather(run([5, 6, 7]), run([8, 9]))
        assert all(isinstance(r, WorkerDiedError) for r in results), results
        with pytest.raises(EngineError, match="rebuilding"):
            engine.check_health()
        engine.check_alive()  # not ready, but alive: a restart would only lose the rebuild
        await wait_for_async(lambda: engine.failure is None, 60, "the engine rebuilt")
        engine.check_health()
        assert engine.llm.engine is not failed_engine and engine.num_rebuilds == 1
        assert await run([5, 6, 7]) == expected
        stats = engine.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.is_healthy
        await engine.shutdown()

    asyncio.run(main())
