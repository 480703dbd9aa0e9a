import os
from pathlib import Path

# Keep torch from spawning more threads than the 2 cores CI has.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Triton kernels run in the Python interpreter on machines without a GPU; it must be set before
# triton is first imported. Kernel dispatch still picks the torch references for CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiling each engine's steps would cost more than the few tokens most tests generate; the tests
# of compiled steps ask for them (enforce_eager=False).
os.environ.setdefault("WARPSPEC_ENFORCE_EAGER", "1")
# One inductor cache for every compiled step of the session (and of later runs here): the tests
# compile the same small models' steps in many engines, each with a run folder of its own, and a cold
# cache builds every kernel with the C++ compiler again. The graphs counted (CountingCompiler) stay the
# same: dynamo calls the backend for every graph, whether inductor then finds its code cached or not.
# The tests of the cache folder itself set or clear this variable.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parent.parent / "runs" / "test-inductor"))

from ray_cluster import ray_cluster  # noqa: E402,F401 - a shared session fixture
