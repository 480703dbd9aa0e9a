import os

# Keep torch from spawning more threads than the 2 cores CI has.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Triton kernels run in the Python interpreter on machines without a GPU; it must be set before
# triton is first imported. Kernel dispatch still picks the torch references for CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiling each engine's steps would cost more than the few tokens most tests generate; the tests
# of compiled steps ask for them (enforce_eager=False).
os.environ.setdefault("WARPSPEC_ENFORCE_EAGER", "1")

from ray_cluster import ray_cluster  # noqa: E402,F401 - a shared session fixture
