"""`warpspec serve` as a user runs it: a process that starts a local Ray cluster, serves until SIGTERM,
then shuts Serve and Ray down and exits 0. Run with its safe defaults (no --host: HTTP on 127.0.0.1
only; no dashboard) and an API key from the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest
import requests

from warpspec.cli.client import GenerationClient
from warpspec.serving.serve_cli import SERVE_ENVIRONMENT, free_local_port

pytestmark = pytest.mark.slow



def test_warpspec_serve_runs_until_sigterm(serving_checkpoint, short_tmp_dir):
    grpc_port, http_port, run_dir = free_local_port(), free_local_port(), short_tmp_dir
    key = "sk-cli-test"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "WARPSPEC_API_KEY": key}
    env.pop("RAY_ADDRESS", None)
    for name in ("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", *SERVE_ENVIRONMENT):  # warpspec serve must set them itself
        env.pop(name, None)
    process = subprocess.Popen([sys.executable, "-m", "warpspec.cli.main", "serve", "--model", str(serving_checkpoint),
                                "--model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
                                "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                                "--max-request-bytes", str(1024 * 1024),
                                "--arg", f"run_dir={run_dir}", "--arg", "num_kv_blocks=32"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        line, startup = "", []
        while "warpspec: serving" not in line:
            line = process.stdout.readline()
            startup.append(line)
            assert line or process.poll() is None, "warpspec serve exited early"
            assert time.monotonic() < deadline, "warpspec serve did not start within 120 s"
        with GenerationClient(f"127.0.0.1:{grpc_port}", timeout=30, api_key=key) as client:
            assert client.health() == "SERVING"
            assert client.generate("def main():", max_tokens=3, temperature=0.0).usage.completion_tokens == 3
            # Serve's gRPC proxy itself refuses a message over --max-request-bytes (the local cluster's
            # processes inherit RAY_SERVE_GRPC_MAX_MESSAGE_SIZE), before it is copied to a replica.
            with pytest.raises(grpc.RpcError) as error:
                client.generate("x" * (2 * 1024 * 1024), max_tokens=1)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with GenerationClient(f"127.0.0.1:{grpc_port}", timeout=30) as keyless:
            assert keyless.health() == "SERVING"  # health stays open
            with pytest.raises(grpc.RpcError) as error:
                keyless.generate("def main():", max_tokens=3)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert requests.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=30).status_code == 401
        # Without --host, HTTP listens on the loopback address only.
        listeners = {c.laddr.ip for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == http_port}
        assert listeners == {"127.0.0.1"}
        # Serve's proxy runs with the serving environment: it reaches the replica over gRPC.
        proxies = [p for p in psutil.Process(process.pid).children(recursive=True)
                   if "ProxyActor" in " ".join(p.cmdline())]
        assert proxies and all(p.environ().get(name) == value for p in proxies
                               for name, value in SERVE_ENVIRONMENT.items())
        # And the local cluster runs no dashboard.
        assert not any(c.status == psutil.CONN_LISTEN and c.laddr.port == 8265 for c in psutil.net_connections("tcp"))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            rest, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0
    # A clear last line, and nothing alarming on the way: neither Serve reconnecting to the instance
    # it just started nor a controller killed mid-shutdown.
    assert rest.strip().splitlines()[-1] == "warpspec: stopped (the local Ray cluster is down)", rest[-2000:]
    assert "Connecting to existing Serve app" not in "".join(startup) + rest and "graceful_shutdown failed" not in rest


def test_warpspec_serve_refuses_a_replica_no_node_can_hold(serving_checkpoint, short_tmp_dir):
    """A replica asking 64 CPUs for itself and one per each of its 4 workers: no node of the local
    cluster (max(8, this machine's cores) logical CPUs) holds the gang. One line naming the node,
    exit status 1."""
    run_dir = short_tmp_dir
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "warpspec.cli.main", "serve", "--model", str(serving_checkpoint),
                           "--workers", "4", "--placement-timeout-s", "2", "--grpc-port", str(free_local_port()),
                           "--http-port", str(free_local_port()), "--arg", f"run_dir={run_dir}",
                           "--arg", "num_cpus=64"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "warpspec: error: a replica needs CPU 68, GPU 0 on one node" in done.stderr
    assert "no node is large enough" in done.stderr and "Traceback" not in done.stderr


def test_the_image_sets_the_serving_environment():
    """Pods of the image run clusters that warpspec serve did not start: they get the same environment."""
    from pathlib import Path

    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    env = dict(item.split("=", 1) for line in dockerfile.splitlines() if line.startswith("ENV ")
               for item in line.split()[1:])
    assert {name: env.get(name) for name in SERVE_ENVIRONMENT} == SERVE_ENVIRONMENT
