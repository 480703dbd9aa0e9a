import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Keep torch from spawning more threads than the 2 cores CI has; spinning OpenMP threads slow another
# process's torch badly (Ray's actors, or a second test process: below).
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but a short spin first (workers/compile/cpu_threads.py), read by libgomp as torch loads it: with none,
# each of a step's parallel regions woke the threads, and entrypoints, core, structured_output and
# sample took 79.8 s against 70.4 s with it (one sitting).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# Triton kernels run in the Python interpreter on machines without a GPU; it must be set before
# triton is first imported. Kernel dispatch still picks the torch references for CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiling each engine's steps would cost more than the few tokens most tests generate; the tests
# of compiled steps ask for them (enforce_eager=False).
os.environ.setdefault("WARPSPEC_ENFORCE_EAGER", "1")
# An engine writes its whole KV cache once at start (zeroed), 1 GiB per rank by default (~0.3 s here),
# and the draft's beside it: 55 engines of the core, entrypoints, structured_output, cli and sample
# tests spent 10.0 s of 122 in it. The tests' models and prompts are small: 128 MiB holds more tokens
# than any of them asks (the bundled target's 43k, the tiny checkpoints' 262k). Tests of the cache's
# size name their own.
os.environ.setdefault("WARPSPEC_KV_CACHE_MEMORY_GIB", "0.125")
# One inductor cache for every compiled step of the session (and of later runs here): the tests
# compile the same small models' steps in many engines, each with a run folder of its own, and a cold
# cache builds every kernel with the C++ compiler again. The graphs counted (CountingCompiler) stay the
# same: dynamo calls the backend for every graph, whether inductor then finds its code cached or not.
# The tests of the cache folder itself set or clear this variable.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parent.parent / "runs" / "test-inductor"))

from helpers.ray_cluster import ray_cluster  # noqa: E402,F401 - a shared session fixture


@pytest.fixture
def short_tmp_dir():
    """A fresh folder under the system's temp dir, removed after the test: a local Ray cluster keeps
    Unix sockets under its run folder, and their paths must stay below ~107 bytes (pytest's tmp_path
    is longer)."""
    folder = tempfile.mkdtemp(prefix="ws-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# `TEST_PROCESSES=2 make test` runs the suite in two processes (pytest-xdist, --dist loadgroup): in one process a cold
# run kept the 2 cores 36% busy (27 CPU-minutes in 38), its compiles waiting on gcc and its serving
# tests on Ray. Every test that starts or joins Ray runs in one of them, one at a time, as the whole suite did
# before: two clusters on one machine would compete for its ports and its session files, and the
# serving tests' timeouts assume one cluster. A test is Ray's when it takes the shared cluster, lives
# in a folder whose tests all start a Serve stack or a cluster in a subprocess, or says so.
RAY_FOLDERS = ("assets", "client", "k8s", "serving")
RAY_FIXTURES = {"ray_cluster"}


def needs_ray(item: pytest.Item) -> bool:
    folder = Path(item.path).relative_to(Path(__file__).parent).parts[0]
    return (folder in RAY_FOLDERS or bool(RAY_FIXTURES & set(item.fixturenames))
            or item.get_closest_marker("ray") is not None)


# The benchmarks' smoke tests run after every other folder: a benchmark runs whole engines, and on the
# configurations the tests of compiled steps use it loads the graphs they saved instead of compiling.
LAST_FOLDERS = ("benchmarks",)


def runs_last(item: pytest.Item) -> bool:
    return Path(item.path).relative_to(Path(__file__).parent).parts[0] in LAST_FOLDERS


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=runs_last)  # stable: each folder keeps its order
    for item in items:
        if needs_ray(item):
            item.add_marker(pytest.mark.xdist_group("ray"))


# The other test process runs at this niceness: the Ray tests (serving, faults, multi-node) time
# health checks, watchdogs and drains, and two processes compiling beside them on 2 cores made a
# stuck-coordinator test miss its deadlines. Niced, the rest of the suite takes the cycles they leave.
# Ray runs its actors at nice 15 (its worker_niceness): below them, 19.
NICE = 19
HOSTS_RAY: list[bool] = []  # this test process has run a Ray test


def yield_the_cores() -> None:
    """Lower every thread of this process (OpenMP's included) to NICE: on Linux a priority is a
    thread's, and anyone may lower their own."""
    with contextlib.suppress(OSError):  # no /proc, or a thread that ended meanwhile
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), max(NICE, os.getpriority(os.PRIO_PROCESS, int(tid))))


@pytest.fixture(autouse=True)
def ray_stays_in_its_process(request, monkeypatch):
    """In a test process of `make test`, a test that is not Ray's and calls ray.init fails at that call,
    naming the marker that fixes it, before a second cluster starts beside the Ray tests' one; the
    process that runs no Ray test yields the cores to the one that does."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    if needs_ray(request.node):
        HOSTS_RAY.append(True)
        yield
        return
    if not HOSTS_RAY:
        yield_the_cores()
    import ray

    def refuse(*args, **kwargs):
        pytest.fail("this test starts Ray: mark it @pytest.mark.ray (or take the ray_cluster fixture) so that it "
                    "runs in the test process that hosts Ray")

    if ray.is_initialized() and not HOSTS_RAY:  # started by a fixture set up before this one
        pytest.fail("this test's fixtures started Ray: mark the tests that use them @pytest.mark.ray")
    monkeypatch.setattr(ray, "init", refuse)
    yield


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """In a test process of `make test`, the Ray tests must carry their group in their ids, which is
    what xdist schedules by: when they do not, two Ray clusters would run at once. xdist 3.8 writes
    the group into Item._nodeid, which pytest 9.2 stopped reading (hence pytest<9.2 in pyproject)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup"):
        ungrouped = [item.nodeid for item in session.items if needs_ray(item) and not item.nodeid.endswith("@ray")]
        if ungrouped:
            raise pytest.UsageError(f"pytest-xdist did not group the tests that use Ray (pytest {pytest.__version__}): "
                                    f"{ungrouped[0]} and {len(ungrouped) - 1} more would run beside each other")
