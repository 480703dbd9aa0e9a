"""Waiting for a condition with a bound, instead of sleeping for a result: a test that sleeps a fixed
time passes or fails with the machine's load; one that polls waits only as long as it must, and its
bound says how long is too long."""

from __future__ import annotations

import asyncio
import time


def wait_for(predicate, timeout_s: float, what: str):
    """predicate's first truthy value, polled every 0.1 s; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.1)
    return value


async def wait_for_async(predicate, timeout_s: float, what: str):
    """wait_for inside an event loop: yields to the loop (the engine's step task) between polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)
    return value


def free_cpus(ray) -> float:
    return ray.available_resources().get("CPU", 0)


def wait_for_cpus(ray, free_before: float, timeout_s: float = 10) -> None:
    """Until the CPUs free before a test are free again: what it placed is released. Compared with the
    count before, not the cluster's 8: other suites' actors (a serving replica) may hold some throughout."""
    wait_for(lambda: free_cpus(ray) >= free_before, timeout_s, f"{free_before:g} free CPUs")
