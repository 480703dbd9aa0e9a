"""`warpspec bench serve` runs both paths side by side, with --tracing the replica front without and
with a tracer too, and writes its table (figures are not
asserted: this machine is noisy). In a subprocess: the benchmark starts its own Ray and Serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from warpspec.serving.serve_config import ServeConfig
from warpspec.training.random_checkpoint import create_random_checkpoint


@pytest.mark.slow
@pytest.mark.ray  # its own Ray and Serve, in a subprocess
def test_bench_serve_writes_its_side_by_side_table(tmp_path):
    model = create_random_checkpoint(tmp_path / "model", "tiny")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_SERVE_PROXY_USE_GRPC", None)  # the benchmark must set it itself
    done = subprocess.run([sys.executable, "-m", "warpspec.cli.main", "bench", "serve", "--model", str(model),
                           "--num-requests", "4", "--concurrency", "2", "--new-tokens", "4", "--repeats", "1",
                           "--run-dir", str(tmp_path), "--tracing"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| AsyncLLM in-process |" in done.stdout and "| gRPC via Ray Serve |" in done.stdout
    report = json.loads((tmp_path / "bench" / "serve.json").read_text())
    assert [r["path"] for r in report["rows"]] == ["AsyncLLM in-process", "gRPC via Ray Serve",
                                                   "replica front, tracing off", "replica front, tracing on"]
    assert "tracing_tokens_per_s_lost_pct" in report and "tracing every request:" in done.stdout
    assert all(r["tokens_per_s"] > 0 for r in report["rows"]) and "tokens_per_s_lost_pct" in report["overhead"]
    assert all(r["itl_ms_p99"] >= r["itl_ms_p50"] >= 0 for r in report["rows"])
    # By default it measures what a deployment ships with: the same stream gap, proxies reaching
    # replicas over gRPC (set_serving_environment).
    assert report["stream_gap_ms"] == ServeConfig.stream_gap_ms and report["proxy_to_replica"] == "gRPC"
