"""`warpspec serve` as a user runs it: a process that starts a local Ray cluster, serves until SIGTERM,
then shuts Serve and Ray down and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from warpspec.client import GenerationClient

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_warpspec_serve_runs_until_sigterm(serving_checkpoint):
    grpc_port, http_port = _free_port(), _free_port()
    run_dir = tempfile.mkdtemp(prefix="ws-cli-")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen([sys.executable, "-m", "warpspec.cli", "serve", "--model", str(serving_checkpoint),
                                "--model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
                                "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--host", "127.0.0.1",
                                "--arg", f"run_dir={run_dir}", "--arg", "num_kv_blocks=32"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "warpspec: serving" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "warpspec serve exited early"
            assert time.monotonic() < deadline, "warpspec serve did not start within 120 s"
        with GenerationClient(f"127.0.0.1:{grpc_port}", timeout=30) as client:
            assert client.health() == "SERVING"
            assert client.generate("def main():", max_tokens=3, temperature=0.0).usage.completion_tokens == 3
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0
