"""Connecting to Ray (an existing cluster when RAY_ADDRESS is set, otherwise a local one), the errors
of remote calls unwrapped to the ones users should see, and the one place Ray's private APIs are used.

Checked against ray 2.60.0 (RAY_CHECKED); tests/executor/test_ray_env.py fails, naming the API, when
an upgrade changes one:
- `ray.init(_temp_dir=...)`: the only way to put a local cluster's session files (and its Unix
  sockets, whose paths must stay short) in a folder of the caller's; every ray.init that starts a
  cluster goes through start_local_ray.
- `ray._private.state.actors()`: every actor's state and node. Its public twin,
  ray.util.state.list_actors, needs the dashboard, which warpspec does not start.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

RAY_CHECKED = "2.60.0"


def start_local_ray(temp_dir: str | Path, num_cpus: int, include_dashboard: bool = False,
                    address: str | None = None, log_to_driver: bool = False) -> None:
    """Start a local Ray cluster (address="local": a new one even when another runs on this machine)
    keeping its session files under temp_dir, reporting no usage statistics, and, unless
    log_to_driver, printing nothing its actors write."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=address, num_cpus=num_cpus, include_dashboard=include_dashboard, _temp_dir=str(temp_dir),
             log_to_driver=log_to_driver)


def live_actors() -> list[dict]:
    """The cluster's live actors: each with its "ActorClassName" and its "Address"'s "NodeID"."""
    return [actor for actor in ray._private.state.actors().values() if actor["State"] == "ALIVE"]


def connect_ray(run_dir: str | Path = "runs", include_dashboard: bool = False, num_cpus: int = 8,
                log_to_driver: bool = False) -> None:
    """Idempotent. A local cluster keeps its session files under run_dir/ray, runs no dashboard unless
    asked (it serves cluster control on a port of its own), reports no usage statistics and offers at
    least num_cpus CPUs (one per worker actor). log_to_driver: print what the actors write to
    stdout and stderr (a replica's start-up phases) in this process."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=log_to_driver)
        return
    temp_dir = Path(run_dir, "ray").resolve()
    temp_dir.mkdir(parents=True, exist_ok=True)
    # Oversubscribe small machines: a 2-core box still hosts a coordinator and a few workers.
    start_local_ray(temp_dir, max(num_cpus, os.cpu_count() or 1), include_dashboard, log_to_driver=log_to_driver)


def unwrap_ray_errors(call):
    """Run call; re-raise the user-facing error a remote task raised (CheckpointError, ValueError, ...)
    instead of Ray's wrapper around it."""
    try:
        return call()
    except RayTaskError as e:
        if e.cause is not None and not isinstance(e.cause, RayActorError):
            raise e.cause from None
        raise
