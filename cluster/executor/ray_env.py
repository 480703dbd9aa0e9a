"""Connecting to Ray (an existing cluster when RAY_ADDRESS is set, otherwise a local one), and the
errors of remote calls unwrapped to the ones users should see."""

from __future__ import annotations

import os
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError


def connect_ray(run_dir: str | Path = "runs", include_dashboard: bool = False, num_cpus: int = 8) -> None:
    """Idempotent. A local cluster keeps its session files under run_dir/ray, runs no dashboard unless
    asked (it serves cluster control on a port of its own), reports no usage statistics and offers at
    least num_cpus CPUs (one per worker actor)."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    temp_dir = Path(run_dir, "ray").resolve()
    temp_dir.mkdir(parents=True, exist_ok=True)
    # Oversubscribe small machines: a 2-core box still hosts a coordinator and a few workers.
    ray.init(num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=include_dashboard, _temp_dir=str(temp_dir),
             log_to_driver=False)

def unwrap_ray_errors(call):
    """Run call; re-raise the user-facing error a remote task raised (CheckpointError, ValueError, ...)
    instead of Ray's wrapper around it."""
    try:
        return call()
    except RayTaskError as e:
        if e.cause is not None and not isinstance(e.cause, RayActorError):
            raise e.cause from None
        raise
