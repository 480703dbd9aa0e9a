"""The autoscaling check (`warpspec bench serve --autoscale`): under sustained gRPC load a second replica
starts and takes traffic, and once the load stops the deployment scales back to one.

Runs on its own local Ray cluster, because Serve's autoscaling metrics are pushed every 10 s by
default (RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, read when Serve's actors start); here they are
pushed every 0.5 s and the deployment looks back 2 s, so the check takes about a minute, not several.
Which replica served a request is read from the `warpspec-replica` trailing metadata of Generate.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

APP_NAME = "warpspec"
DEPLOYMENT_NAME = "WarpspecServer"
SPLIT_WINDOW_S = 5.0


def _running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or DEPLOYMENT_NAME not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT_NAME].replica_states.get("RUNNING", 0)


def _wait_for(condition, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"autoscaling check: {what} did not happen within {timeout_s:g} s")
        time.sleep(0.25)
    return time.monotonic() - start


class _Load:
    """concurrency threads each sending Generate back to back, counting replies per replica."""

    def __init__(self, target: str, concurrency: int, max_tokens: int):
        import grpc

        from warpspec.protos.warpspec.v1 import generation_pb2 as pb
        from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc
        from warpspec.serving.deployment import REPLICA_METADATA_KEY

        self.channel = grpc.insecure_channel(target)
        stub = pb_grpc.GenerationStub(self.channel)
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 5, 9, 13]),
                                     params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self.served_by: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.stop = threading.Event()
        lock = threading.Lock()

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    _, call = stub.Generate.with_call(request, timeout=60)
                    replica = dict(call.trailing_metadata() or ()).get(REPLICA_METADATA_KEY, "?")
                    with lock:
                        self.served_by[replica] += 1
                except grpc.RpcError as e:
                    with lock:
                        self.errors[e.code().name] += 1

        self.threads = [threading.Thread(target=loop, daemon=True) for _ in range(concurrency)]
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)
        self.channel.close()


def run_autoscale_check(model_dir: str | Path, concurrency: int = 8, max_tokens: int = 32,
                        timeout_s: float = 120.0) -> dict:
    """Returns the timings and the replies each replica served; raises TimeoutError when a step fails."""
    os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from warpspec.executor.ray_env import start_local_ray
    from warpspec.serving.serve_cli import free_local_port, start_serving

    scratch = tempfile.mkdtemp(prefix="ws-scale-")  # Ray's session files, removed after
    start_local_ray(scratch, num_cpus=4)
    load = None
    try:
        grpc_port = free_local_port()
        start_serving({"model": str(model_dir), "dtype": "float32", "num_kv_blocks": 64, "min_replicas": 1,
                       "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 1,
                       "downscale_delay_s": 3, "look_back_period_s": 2,
                       "metrics_interval_s": 0.5},
                      grpc_port=grpc_port, http_port=free_local_port(), host="127.0.0.1")
        assert _running_replicas() == 1
        load = _Load(f"127.0.0.1:{grpc_port}", concurrency, max_tokens)
        scaled_up_s = _wait_for(lambda: _running_replicas() == 2, timeout_s, "scaling up to 2 replicas")
        _wait_for(lambda: len(load.served_by) >= 2, timeout_s, "the second replica serving requests")
        # How the load splits once both replicas run: the replies of the next few seconds.
        before = Counter(load.served_by)
        time.sleep(SPLIT_WINDOW_S)
        served_by = dict(Counter(load.served_by) - before)
        load.close()
        load_errors = dict(load.errors)
        load = None
        scaled_down_s = _wait_for(lambda: _running_replicas() == 1, timeout_s, "scaling back down to 1 replica")
        return {"scaled_up_after_s": scaled_up_s, "scaled_down_after_s": scaled_down_s,
                "replies_per_replica": served_by, "split_window_s": SPLIT_WINDOW_S, "errors": load_errors}
    finally:
        if load is not None:
            load.close()
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
