"""Serve a checkpoint on a private local Ray cluster whose processes trace (the OTEL_* variables of this
process's environment reach the proxy and the replica), send one streamed gRPC request with a
traceparent, and print its token count: `python traced_stack.py CHECKPOINT TRACEPARENT TEMP_DIR`.
Its own process and cluster: the proxy reads the environment it starts with, and the serving tests
keep theirs running on the shared cluster without traces."""

import json
import os
import sys
import time

import grpc
import ray
from ray import serve

from warpspec.executor.ray_env import start_local_ray
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as rpc
from warpspec.serving.serve_cli import free_local_port, start_serving


def main(checkpoint: str, traceparent: str, temp_dir: str) -> dict:
    start_local_ray(temp_dir, num_cpus=2, address="local")
    try:
        port = free_local_port()
        start_serving({"model": checkpoint, "dtype": "float32", "max_model_len": 128, "num_kv_blocks": 32},
                      grpc_port=port, http_port=free_local_port())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(prompt="def main():", params=pb.SamplingParams(
                max_tokens=4, temperature=0.0, ignore_eos=True))
            replies = rpc.GenerationStub(channel).GenerateStream(request, metadata=[("traceparent", traceparent)],
                                                                 timeout=120)
            num_tokens = sum(len(reply.token_ids) for reply in replies)
        # The proxy exports its spans every OTEL_BSP_SCHEDULE_DELAY ms (the test sets 100) and is
        # stopped without a flush: give its last batch time to go out.
        time.sleep(3)
        return {"num_tokens": num_tokens}
    finally:
        serve.shutdown()  # the replica's tracer sends what it holds as the replica stops
        ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    print(json.dumps(main(*sys.argv[1:])))
