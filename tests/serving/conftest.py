"""One serving stack for every test under tests/serving: `warpspec serve`'s own start function on the
shared local Ray cluster, a tiny random checkpoint, one replica running the model in its own process.
Tests talk to it only over the network (gRPC on the Serve gRPC proxy, HTTP on the Serve HTTP proxy).
Serve is shut down at the end; the Ray cluster belongs to the ray_cluster fixture."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from warpspec.serving.serve_cli import free_local_port, set_serving_environment
from warpspec.training.random_checkpoint import create_random_checkpoint

# Before the session's Ray cluster starts (ray_cluster), so that its Serve processes run as `warpspec
# serve`'s do: the proxies reach replicas over gRPC.
set_serving_environment()

MODEL_NAME = "tiny"
# Small enough for 2 cores, long enough that a 400-token request outlives a 0.2 s deadline.
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 64, "max_waiting_requests": 64}


@dataclass
class Stack:
    grpc_target: str  # host:port of Serve's gRPC proxy
    http_base: str  # http://host:port of Serve's HTTP proxy
    model_path: Path
    startup_health: list[str]  # what a health client polling during start-up was told (HealthProbe)

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.http_base}/admin/stats", timeout=10) as reply:
            return json.loads(reply.read())

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """Stats once no request is in flight and every KV block is free again (none leaked)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            idle = stats["num_in_flight"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
            if idle and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"the replica did not return to idle with all KV blocks free: {stats}")
            time.sleep(0.05)

    def wait_aborted(self, expected: int, within_s: float = 1.0) -> float:
        """Seconds until the replica has aborted `expected` requests in all (num_aborted counts only
        requests whose client went away before they finished) and is idle with every KV block free.
        Fails if that takes longer than within_s, counted from the call: the moment the client gave up."""
        start = time.monotonic()
        while True:
            stats = self.stats()
            idle = stats["num_in_flight"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
            if stats["num_aborted"] >= expected and idle and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
                assert stats["num_aborted"] == expected, stats
                return time.monotonic() - start
            if time.monotonic() - start > within_s:
                raise AssertionError(f"no abort within {within_s} s: expected num_aborted {expected}, {stats}")
            time.sleep(0.02)

    def wait_running(self, timeout_s: float = 10.0) -> None:
        """Returns once a request is running (generating) on the replica."""
        deadline = time.monotonic() + timeout_s
        while self.stats()["num_running"] == 0:
            if time.monotonic() > deadline:
                raise AssertionError("no request started running")
            time.sleep(0.02)



@pytest.fixture(scope="session")
def serving_checkpoint(tmp_path_factory) -> Path:
    return create_random_checkpoint(tmp_path_factory.mktemp("serving") / "tiny", "tiny", std=0.3)


@pytest.fixture(scope="session")
def serving_stack(ray_cluster, serving_checkpoint):
    from ray import serve

    from warpspec.serving.serve_cli import start_serving

    grpc_port, http_port = free_local_port(), free_local_port()
    args = {"model": str(serving_checkpoint), "model_name": MODEL_NAME, **ENGINE_ARGS}
    probe = HealthProbe(f"127.0.0.1:{grpc_port}")
    probe.start()
    try:
        start_serving(args, grpc_port=grpc_port, http_port=http_port, host="127.0.0.1")
    finally:
        probe.stop()
    try:
        yield Stack(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", serving_checkpoint, probe.seen)
    finally:
        serve.shutdown()


class HealthProbe(threading.Thread):
    """A stock gRPC health client polling while the stack starts, as a Kubernetes probe would: each
    answer it got, in order, repeats dropped (a status name, or the error code's)."""

    def __init__(self, target: str):
        super().__init__(daemon=True)
        self.target, self.seen, self.done = target, [], threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self.done.is_set():
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    answer = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.RpcError as error:
                    answer = error.code().name
                if not self.seen or self.seen[-1] != answer:
                    self.seen.append(answer)
                self.done.wait(0.2)

    def stop(self) -> None:
        self.done.set()
        self.join()


@pytest.fixture(scope="session")
def reference_llm(serving_checkpoint):
    """The in-process engine on the same checkpoint and settings: what the network must reproduce."""
    from warpspec.entrypoints.llm import LLM

    llm = LLM(str(serving_checkpoint), dtype=ENGINE_ARGS["dtype"], max_model_len=ENGINE_ARGS["max_model_len"],
              num_kv_blocks=ENGINE_ARGS["num_kv_blocks"])
    yield llm
    llm.shutdown()
