"""The thread count of compiled CPU steps: the candidates, the timing that picks one, that a
chosen count is restored after the block that ran with it, and the advice given where OpenMP's
threads sleep between regions."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest
import torch

from warpspec.workers.compile.compiled_step import CountingCompiler
from warpspec.workers.compile.cpu_threads import (
    CLEAR_WIN,
    TIMED_RUNS,
    advise_on_sleeping_threads,
    candidate_thread_counts,
    fastest_thread_count,
    graph_thread_count,
    in_a_passing_thread,
    sleeping_threads_advice,
    torch_threads,
)


@pytest.mark.parametrize("most,counts", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_candidates_are_powers_of_two_and_the_most(most, counts):
    assert candidate_thread_counts(most) == counts


def test_torch_threads_restores_the_count_even_when_the_block_raises():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("step failed")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("slow_when_parallel", [True, False])
def test_the_fastest_count_wins(slow_when_parallel):
    def run():
        parallel = torch.get_num_threads() > 1
        time.sleep(0.004 if parallel == slow_when_parallel else 0.0)

    count, times = fastest_thread_count(run, most=2)
    assert count == (1 if slow_when_parallel else 2)
    assert set(times) == {1, 2} and all(t < float("inf") for t in times.values())


def test_a_lone_sequence_takes_fewer_threads_only_when_they_ran_clearly_faster():
    """Where OpenMP's threads spin, the eager step of 1 and 2 threads comes within a few percent in
    either order while the compiled step is faster on 2; where they sleep, 1 wins several times over."""
    def timed(times):
        calls = []
        return calls, lambda: calls.append(1) or (min(times, key=times.__getitem__), times)

    with torch_threads(2):
        calls, close = timed({1: 0.0040, 2: 0.0044})
        assert graph_thread_count(1, None, close) == 2 and calls == [1]
        _, clear = timed({1: 0.0040, 2: 0.0040 * CLEAR_WIN})
        assert graph_thread_count(1, None, clear) == 1
        _, more_wins = timed({1: 0.0050, 2: 0.0040})
        assert graph_thread_count(1, None, more_wins) == 2
        # A saved build's count stands, and several sequences run torch's count: neither is timed.
        calls, clear = timed({1: 0.001, 2: 0.004})
        assert graph_thread_count(1, 2, clear) == 2 and graph_thread_count(2, None, clear) == 2 and calls == []


def test_timing_runs_compiled_functions_eagerly():
    """A graph guards on the thread count: timing a compiled function with each count would build it
    once per count. The timing runs it uncompiled instead."""
    compiled = CountingCompiler(lambda x: torch.relu(x) * 2)
    x = torch.randn(8)
    fastest_thread_count(lambda: compiled(x), most=2)
    assert compiled.num_compiles == 0 and compiled.num_calls == 2 * TIMED_RUNS


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_passing_thread_ends_with_its_openmp_pool():
    """Built in a thread that then ends, an engine leaves no second OpenMP pool behind to slow the
    thread that steps it (workers/compile/cpu_threads.py), while the event loop that built it lives on."""
    torch.randn(64, 4096).softmax(-1)  # this thread's own pool, if it had none yet
    before = _num_threads()

    def compute():
        with torch_threads(2):
            torch.randn(64, 4096).softmax(-1)  # a parallel region: this thread gets a pool of its own
        return threading.current_thread(), _num_threads()

    async def build_then_serve():
        thread, during = await in_a_passing_thread(compute)
        deadline = time.monotonic() + 5
        while _num_threads() > before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the pool's workers exit as their master does
        return thread, during, _num_threads()

    thread, during, after = asyncio.run(build_then_serve())
    assert not thread.is_alive() and thread is not threading.current_thread()
    assert during > before  # the thread itself, and its pool's worker
    assert after == before


def test_a_passing_thread_returns_the_value_and_raises_the_error():
    assert asyncio.run(in_a_passing_thread(lambda a, b=0: a + b, 2, b=3)) == 5

    def fail():
        raise ValueError("bad model path")

    with pytest.raises(ValueError, match="bad model path"):
        asyncio.run(in_a_passing_thread(fail))


def test_sleeping_threads_are_named_with_what_to_set_once_a_process(monkeypatch, caplog):
    """PASSIVE without GOMP_SPINCOUNT, 2 threads: the advice names both variables and the value; a
    spin count, one thread or another wait policy need none."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr("warpspec.workers.compile.cpu_threads._advised", [])
    with torch_threads(2):
        advice = sleeping_threads_advice()
        assert advice is not None and "OMP_WAIT_POLICY=PASSIVE" in advice and "GOMP_SPINCOUNT=10000" in advice
        with caplog.at_level(logging.WARNING, logger="warpspec.workers.compile.cpu_threads"):
            advise_on_sleeping_threads()
            advise_on_sleeping_threads()
        assert [r.getMessage() for r in caplog.records] == [advice]
        monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
        assert sleeping_threads_advice() is None
        monkeypatch.delenv("GOMP_SPINCOUNT")
        monkeypatch.setenv("OMP_WAIT_POLICY", "active")
        assert sleeping_threads_advice() is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with torch_threads(1):
        assert sleeping_threads_advice() is None
