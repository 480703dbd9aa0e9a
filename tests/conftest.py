import os

# Keep torch from spawning more threads than the 2 cores CI has.
os.environ.setdefault("OMP_NUM_THREADS", "2")

from ray_cluster import ray_cluster  # noqa: E402,F401 - a shared session fixture
