"""Sustained load adds a second replica that takes traffic; without load the deployment scales back
to one (`warpspec bench serve --autoscale`, in a subprocess: it runs its own Ray cluster with fast
autoscaling metrics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from warpspec.training.random_checkpoint import create_random_checkpoint


@pytest.mark.slow
def test_second_replica_starts_takes_traffic_and_goes(tmp_path):
    model = create_random_checkpoint(tmp_path / "model", "tiny")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-m", "warpspec.cli.main", "bench", "serve", "--autoscale", "--model",
                           str(model), "--run-dir", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "bench" / "serve_autoscale.json").read_text())
    replies = result["replies_per_replica"]
    assert len(replies) == 2 and min(replies.values()) > 0, replies  # both replicas served in the window
    assert result["scaled_down_after_s"] > 0 and not result["errors"]
