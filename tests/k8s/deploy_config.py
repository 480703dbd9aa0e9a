"""Deploy a Serve config file the way `serve deploy` does, on a private local Ray cluster, and report
what a client sees: `python deploy_config.py CONFIG MODEL HTTP_PORT GRPC_PORT TEMP_DIR` prints one JSON
line. The Serve controller builds the application from the file's import_path and args, so this runs the
config itself, not a copy of its settings. Its own process and cluster, because Serve is one per Ray
cluster and the serving tests keep theirs running on the shared one."""

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import ray
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve
from ray.serve.schema import ServeDeploySchema

from warpspec.executor.ray_env import start_local_ray
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as rpc
from warpspec.serving.serve_internals import serve_start


def main(config_path: str, http_port: int, grpc_port: int, temp_dir: str) -> dict:
    config = yaml.safe_load(Path(config_path).read_text())
    # Only what cannot travel: free ports on this machine, and checkpoint paths made absolute (they
    # are relative to the repository, where `serve deploy` would be run from).
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    repo = Path(config_path).resolve().parents[1]
    for app in config["applications"]:
        for key in ("model", "draft"):
            if app["args"].get(key):
                app["args"][key] = str(repo / app["args"][key])
    schema = ServeDeploySchema.model_validate(config)
    # address="local": a new cluster even when another is running on this machine.
    start_local_ray(temp_dir, num_cpus=4, address="local")
    try:
        client = serve_start(http_options=schema.http_options.model_dump(),
                             grpc_options=schema.grpc_options.model_dump())
        client.deploy_apps(schema, _blocking=False)
        name = config["applications"][0]["name"]
        deadline = time.monotonic() + 240
        status = None
        while time.monotonic() < deadline:
            status = serve.status().applications.get(name)
            if status is not None and status.status in ("RUNNING", "DEPLOY_FAILED"):
                break
            time.sleep(1)
        if status is None:
            return {"status": "NOT_DEPLOYED", "message": f"no application {name!r} after 240 s"}
        # The deployments' messages carry the replica's exception (e.g. a bad arg for the builder).
        messages = [status.message] + [d.message for d in status.deployments.values() if d.message]
        report = {"status": str(status.status.value), "message": "\n".join(messages)}
        if report["status"] != "RUNNING":
            return report
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        liveness = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"),
                                                             timeout=30)
        reply = rpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt="Hello", params=pb.SamplingParams(max_tokens=4, temperature=0.0)), timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as http_reply:
            models = json.loads(http_reply.read())
        return report | {"health": health_pb2.HealthCheckResponse.ServingStatus.Name(health.status),
                         "liveness": health_pb2.HealthCheckResponse.ServingStatus.Name(liveness.status),
                         "num_generated": len(reply.token_ids), "models": [m["id"] for m in models["data"]]}
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    config_path, http_port, grpc_port, temp_dir = sys.argv[1:]
    print(json.dumps(main(config_path, int(http_port), int(grpc_port), temp_dir)))
