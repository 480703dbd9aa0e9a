"""How many torch threads a compiled step runs with on a CPU: torch's count, unless fewer ran a lone
sequence's step clearly faster at start-up.

A step of a small model is a few dozen parallel regions (GEMM calls and fused loops) of microseconds
each. Whether more threads pay depends on how OpenMP threads wait between regions, which torch cannot
see. Measured decoding the bundled target at batch 1 on 2 cores:
- spinning (libgomp's default): threads start a region at once, and 2 threads run the step 1.45x
  faster than 1;
- sleeping (OMP_WAIT_POLICY=PASSIVE, what a machine shared with other processes needs): each region
  wakes its threads, ~65 us for a 256 x 384 GEMM that computes in 7 us, and 1 thread runs the step
  2.5x faster than 2.
So the count of a compiled graph for one sequence is timed at start-up, eagerly (the eager step has
the same many short regions; a graph guards on the thread count it was built with, so timing it
compiled would build it once per count), and a count below torch's is kept only when it ran the
eager step CLEAR_WIN times as fast. The eager step tells sleeping threads apart, not a small
difference: with threads that spin briefly (GOMP_SPINCOUNT=10000 beside PASSIVE, what an engine
advises) the eager step of 1 and 2 threads came within 1-15% of each other, in either order from one
start to the next, while the compiled step ran 1.18-1.34x faster on 2 threads than on 1 (the
`small` preset and the bundled target); when they sleep, 1 thread ran the eager step 1.9-2.0x and
the compiled step 3.4-4.2x faster (benchmarks/results/2026-12-06-one-sequence-threads-cpu.md).
A graph for two or more sequences serves every batch up to max_num_seqs, and runs with torch's
count: the eager proxy misjudges it. On the bundled target under PASSIVE, eager steps of 8
sequences timed 1 thread faster in every start (4.0-4.5 ms against 4.3-5.5), and at 32 in bfloat16
too, while the compiled graph at 2 threads against 1 generated 128 tokens 1.00-1.08x as fast at batch
8 in float32 (1.16-1.21x bfloat16), 1.29x (1.25x) at 32 and 1.37x (1.49x) at 64, and 0.90x (1.10x) at
batch 2. Eager steps (prefill chunks, mixed batches) keep torch's count: their regions are long.

Which thread computes matters too. OpenMP (libgomp) keeps a pool of worker threads for every thread
that has run a parallel region, for as long as that thread lives; once a process holds more of them
than it has CPUs, every pool's waits become sleeps, as under PASSIVE. Built in one thread and stepped
in another, an engine of 2 threads on 2 cores decoded the bundled target at 186 tok/s instead of
685 (a [64, 512] softmax: 75 us instead of 10). So an engine computes from one thread for its life,
or is built in a thread that ends once it is built (in_a_passing_thread), taking its pool with it.

How long a waiting thread spins before it sleeps is libgomp's GOMP_SPINCOUNT (iterations of a pause
loop). OMP_WAIT_POLICY=PASSIVE makes it 0, so threads sleep between a step's regions and every region
wakes them, at a cost that is the host's and changes with it. On the same 2-core VM on 2026-12-06 the
bundled target's compiled decode under PASSIVE took 5.94 ms a step at batch 2 (1.95 ms with every
count at 1 thread) and 17.3 ms at 64, against 1.51 and 12.5 ms with GOMP_SPINCOUNT=10000 beside
PASSIVE (1.40 and 12.5 with libgomp's default spinning). A short spin keeps the threads awake through
a step's back-to-back regions, and once it runs out between steps they sleep, leaving the cores to
other processes as PASSIVE does. An engine on a CPU says so at start-up (sleeping_threads_advice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")
logger = logging.getLogger(__name__)

TIMED_RUNS = 5  # per candidate, interleaved; the minimum is kept (noise only ever adds time)
CLEAR_WIN = 1.5  # how much faster eagerly a count below torch's must be for a lone sequence's graph


def candidate_thread_counts(most: int) -> list[int]:
    """1, 2, 4, ... up to most, and most itself."""
    counts = [1]
    while counts[-1] * 2 < most:
        counts.append(counts[-1] * 2)
    return sorted(set(counts) | {most})


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with count intra-op threads, then restore the count before it. torch's setting
    is per process: the engine steps from one thread, so nothing else computes meanwhile."""
    before = torch.get_num_threads()
    if count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fastest_thread_count(run: Callable[[], object], most: int | None = None) -> tuple[int, dict[int, float]]:
    """Time run() eagerly with every candidate count up to most (torch's current count), TIMED_RUNS
    times each in turn; the fastest count and each count's best time in seconds. Eagerly: any
    torch.compile'd function run calls runs uncompiled (compiling it once per count would be the
    cost this avoids). run must be safe to repeat (a warm-up step writes KV into blocks no request
    holds)."""
    most = most or torch.get_num_threads()
    counts = candidate_thread_counts(most)
    best = {count: float("inf") for count in counts}
    if len(counts) == 1:
        return counts[0], best
    with torch.compiler.set_stance("force_eager"):
        for _ in range(TIMED_RUNS):
            for count in counts:
                with torch_threads(count):
                    start = time.perf_counter()
                    run()
                    best[count] = min(best[count], time.perf_counter() - start)
    return min(counts, key=best.__getitem__), best


def graph_thread_count(num_seqs: int, saved: int | None,
                       time_eagerly: Callable[[], tuple[int, dict[int, float]]]) -> int:
    """The thread count a compiled graph of num_seqs sequences is built and run with (the module
    docstring): for one sequence, its saved build's (step_artifacts.py), or else the fastest count
    eagerly (time_eagerly: fastest_thread_count's answer, asked only then) if it ran CLEAR_WIN times
    as fast as torch's count, and torch's count otherwise; for more, torch's count, whatever a saved
    build has."""
    most = torch.get_num_threads()
    if num_seqs > 1:
        return most
    if saved is not None:
        return saved
    fastest, times = time_eagerly()
    return fastest if fastest == most or times[fastest] * CLEAR_WIN <= times[most] else most


async def in_a_passing_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """await fn(*args, **kwargs) run in a new thread that ends when fn returns (asyncio.to_thread's
    threads outlive the call, and with them the OpenMP pool of whatever they computed: see the
    module docstring)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="warpspec-build") as pool:
        return await asyncio.wrap_future(pool.submit(fn, *args, **kwargs))


SHORT_SPIN = "10000"  # GOMP_SPINCOUNT advised beside OMP_WAIT_POLICY=PASSIVE (the module docstring)
_advised: list[bool] = []  # once a process


def sleeping_threads_advice() -> str | None:
    """What to set, when this process's OpenMP threads sleep between parallel regions (PASSIVE, no
    GOMP_SPINCOUNT) and torch computes with more than one; None otherwise. libgomp reads both
    variables as it loads, so only the environment a process starts with can change them."""
    if (torch.get_num_threads() < 2 or os.environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive"
            or os.environ.get("GOMP_SPINCOUNT")):
        return None
    return (f"OMP_WAIT_POLICY=PASSIVE without GOMP_SPINCOUNT: the {torch.get_num_threads()} OpenMP threads "
            "sleep between a step's parallel regions and each region wakes them (the bundled target's "
            "decode at batch 2 took 3.9x as long as with GOMP_SPINCOUNT=10000 on a 2-core VM); start the "
            f"process with GOMP_SPINCOUNT={SHORT_SPIN} to keep them awake through a step")


def advise_on_sleeping_threads() -> None:
    """Log sleeping_threads_advice once a process, where it applies."""
    advice = sleeping_threads_advice()
    if advice is not None and not _advised:
        _advised.append(True)
        logger.warning(advice)
