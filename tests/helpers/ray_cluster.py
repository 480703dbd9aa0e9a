"""One local Ray cluster shared by the tests that need it, started the way warpspec expects on a
small machine: auth off (the `ray` CLI needs it), no dashboard, session files in the run folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

RUN_DIR = Path(__file__).resolve().parents[2] / "runs"
SESSION_FOLDER: list[Path] = []  # the folder the shared cluster was started in


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp_dir = RUN_DIR / "test-ray"
    # Unix socket paths under the temp dir must stay below ~107 bytes.
    if len(str(temp_dir)) > 50:
        temp_dir = Path(tempfile.mkdtemp(prefix="ws-ray-"))
    temp_dir.mkdir(parents=True, exist_ok=True)
    from warpspec.executor.ray_env import start_local_ray

    start_local_ray(temp_dir, num_cpus=8)
    SESSION_FOLDER.append(temp_dir)
    yield ray
    ray.shutdown()
