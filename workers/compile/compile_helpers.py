"""A cold start's compiled step graphs built several at once, in helper processes forked from it.

A graph's build (dynamo's trace, AOTAutograd, inductor's code generation and gcc) keeps one core
busy: one after another, the bundled pair's 12 graphs took 170 s of a cold start on 2 cores (the
target's 4 110.7 s, the draft's 8 59.4 s), and 89.5 s with one helper, the same tokens
(benchmarks/results/2026-12-07-compile-helpers-cpu.md). Saved graphs need the model's shapes, not
its weights (step_artifacts.py): a process that built graphs of a model whose weights were never
read saved files a real engine loaded and ran with the same tokens
(benchmarks/results/2026-12-07-graphs-from-unloaded-weights-cpu.md). So a start hands its missing
graphs out: it forks helpers (the model's memory shared, copy-on-write), and each of them and the
start itself take the next build from one queue, the longest first, until none is left. A helper
saves what it builds in the compile cache folder and exits; the start then loads those files as any
saved graph, and builds itself whatever a helper did not save (a helper that failed costs time,
never a graph), or one it stopped (a helper still running long after the start's own builds).

Helpers are forked from a new thread. libgomp keeps an OpenMP thread pool per thread that ran a
parallel region, and a process forked from such a thread hangs in its first parallel region (a
matmul after a fork from the main thread did, here); a new thread has no pool, so the child starts
one of its own. Only the forking thread lives on in a helper, and a helper ends with os._exit:
nothing of the parent (Ray, gRPC, pytest) runs or shuts down in it.

How many: WARPSPEC_COMPILE_HELPERS, or else one fewer than torch's thread count (the cores the
engine computes with, idle while it starts), never more than builds to share. A GPU process never
forks (CUDA does not survive a fork).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from warpspec.workers.compile import step_artifacts
from warpspec.workers.compile.torch_internals import inductor_config_patched

logger = logging.getLogger(__name__)

ENV = "WARPSPEC_COMPILE_HELPERS"
_MAX_BUILDS = 255  # one byte per build in the queue
# Once the start's own builds are done, how long it waits for its helpers before it stops them and
# builds what they did not save: this long, or GRACE_BUILDS times its own longest build if longer.
HELPER_GRACE_S = 120.0
GRACE_BUILDS = 4


def helper_count(num_builds: int) -> int:
    """How many helpers to fork for num_builds builds (the module docstring)."""
    named = os.environ.get(ENV, "").strip()
    if named:
        try:
            wanted = int(named)
        except ValueError:
            raise ValueError(f"{ENV} must be a whole number of helper processes (0 for none), "
                             f"not {named!r}") from None
        if wanted < 0:
            raise ValueError(f"{ENV} must be 0 or more, not {wanted}")
    else:
        wanted = torch.get_num_threads() - 1
    if not hasattr(os, "fork") or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    return max(0, min(wanted, num_builds - 1))


def build_in_helpers(builds: Sequence[Callable[[], object]], desc: str) -> int:
    """Run every build once, some in this process and the rest in helpers forked from it, all at
    once; return how many helpers ran. A build compiles graphs and saves them whole
    (step_artifacts.py); this process keeps what its own builds compiled, and a later load of a file
    a helper saved counts as a graph this start compiled (step_artifacts.built_by_helpers). With no
    helper to fork, nothing runs here: the caller's own warm-up builds each graph as before."""
    helpers = helper_count(len(builds))
    if helpers == 0:
        return 0
    if len(builds) > _MAX_BUILDS:
        raise ValueError(f"{len(builds)} builds: at most {_MAX_BUILDS} are shared out at once")
    start = time.perf_counter()
    queue_read, queue_write = os.pipe()
    os.write(queue_write, bytes(range(len(builds))))  # a read of one byte takes one build
    os.close(queue_write)  # every taker reads to the end, then sees it ends
    done_read, done_write = os.pipe()
    pids = _fork_helpers(helpers, builds, queue_read, done_read, done_write)
    os.close(done_write)  # the helpers' copies close as they exit: the end of done_read
    progress = tqdm(total=len(builds), desc=desc, unit="graph", disable=None, leave=False)
    saved: list[str] = []
    reader = threading.Thread(target=_read_done, args=(done_read, saved, progress), daemon=True)
    reader.start()
    longest = 0.0
    try:
        while (index := _take(queue_read)) is not None:
            began = time.perf_counter()
            builds[index]()
            longest = max(longest, time.perf_counter() - began)
            progress.update()
    finally:
        os.close(queue_read)
        failed = _wait_for(pids, grace_s=max(HELPER_GRACE_S, GRACE_BUILDS * longest))
        reader.join()
        os.close(done_read)
        progress.close()
    step_artifacts.built_by_helpers.update(saved)
    logger.info("%d graph builds in %.1f s, %d graphs saved by %d helper processes%s", len(builds),
                time.perf_counter() - start, len(saved), helpers,
                f" ({failed} failed or were stopped: this process builds what they did not save)" if failed else "")
    return helpers


def _wait_for(pids: list[int], grace_s: float) -> int:
    """Reap the helpers, killing any still running after grace_s (a helper that hangs must not hang
    the start: a lock another thread held at the fork stays held in the child); how many failed."""
    deadline, failed = time.monotonic() + grace_s, 0
    for pid in pids:
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if status[0] == 0:
            logger.warning("compile helper %d still running %.0f s after the start's own builds; stopping it",
                           pid, grace_s)
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)
        failed += status[1] != 0
    return failed


def _fork_helpers(helpers: int, builds: Sequence[Callable[[], object]], queue_read: int, done_read: int,
                  done_write: int) -> list[int]:
    """Fork the helpers from a new thread (the module docstring); their pids."""
    pids: list[int] = []
    parent, threads = os.getpid(), torch.get_num_threads()

    def fork() -> None:
        for _ in range(helpers):
            pid = os.fork()
            if pid == 0:
                _helper(builds, queue_read, done_read, done_write, parent, threads)
            pids.append(pid)

    forker = threading.Thread(target=fork, name="warpspec-compile-fork")
    forker.start()
    forker.join()
    return pids


def _helper(builds: Sequence[Callable[[], object]], queue_read: int, done_read: int, done_write: int,
            parent: int, threads: int) -> None:
    """A helper's life: take builds until none is left or its parent is gone; after each, write one
    line of the files it saved (tab-separated, maybe none) to done_write. Never returns."""
    status = 1
    try:
        os.close(done_read)
        torch.set_num_threads(threads)  # a new thread's OpenMP count is the default, not the engine's
        with inductor_config_patched({"compile_threads": 1}):  # no compile workers: this is one
            while os.getppid() == parent and (index := _take(queue_read)) is not None:
                before = len(step_artifacts.saved_here)
                builds[index]()
                os.write(done_write, ("\t".join(step_artifacts.saved_here[before:]) + "\n").encode())
        status = 0
    except BaseException:  # noqa: BLE001 - whatever happened, the parent builds what is not saved
        logger.exception("a compile helper failed")
    finally:
        os._exit(status)


def _take(queue_read: int) -> int | None:
    """The next build's index, or None when the queue is empty."""
    taken = os.read(queue_read, 1)
    return taken[0] if taken else None


def _read_done(done_read: int, saved: list[str], progress: tqdm) -> None:
    """Collect the helpers' lines until every helper has exited (in a thread of the parent)."""
    pending = b""
    while chunk := os.read(done_read, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            saved.extend(path for path in line.decode().split("\t") if path)
            progress.update()
