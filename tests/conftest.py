import os
import sys
from pathlib import Path

import pytest

# Keep torch from spawning more threads than the 2 cores CI has. `make test` runs two test processes
# (below), and spinning OpenMP threads in one slow the other's torch badly.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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

# `make test` runs the suite in two processes (pytest-xdist, --dist loadgroup): on 2 cores one
# process left a core idle for a third of the run, while a compile waited on gcc or a test waited on
# Ray. Every test that starts or joins Ray runs in one of them, one at a time, as the whole suite did
# before: two clusters on one machine would compete for its ports and its session files, and the
# serving tests' timeouts assume one cluster. A test is Ray's when it takes the shared cluster, lives
# in a folder whose tests all start a Serve stack or a cluster in a subprocess, or says so.
RAY_FOLDERS = ("assets", "client", "k8s", "serving")
RAY_FIXTURES = {"ray_cluster"}


def needs_ray(item: pytest.Item) -> bool:
    folder = Path(item.path).relative_to(Path(__file__).parent).parts[0]
    return (folder in RAY_FOLDERS or bool(RAY_FIXTURES & set(item.fixturenames))
            or item.get_closest_marker("ray") is not None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if needs_ray(item):
            item.add_marker(pytest.mark.xdist_group("ray"))


def ray_running() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


@pytest.fixture(autouse=True)
def ray_stays_in_its_process(request):
    """A test that left Ray running without being Ray's would share the machine with the other test
    process's cluster: it fails here, naming the marker that fixes it."""
    before = ray_running()
    yield
    if not before and ray_running() and not needs_ray(request.node):
        pytest.fail("this test started Ray: mark it @pytest.mark.ray (or take the ray_cluster fixture) so that "
                    "it runs in the test process that hosts Ray")
