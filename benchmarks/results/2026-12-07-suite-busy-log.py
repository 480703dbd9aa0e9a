"""A pytest plugin that logs, for every test (setup, call and teardown), its wall seconds and the CPU
seconds the whole machine spent meanwhile (every process's: Ray's actors and subprocesses included,
from /proc/stat), one JSON line each, to $BUSY_LOG (default busy-log.jsonl). Linux only.

    PYTHONPATH=benchmarks/results python -m pytest -p 2026-12-07-suite-busy-log ...
"""

import json
import os
import time

import pytest


def machine_cpu_s() -> float:
    """CPU seconds of every core since boot, idle and iowait left out."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.monotonic(), machine_cpu_s()
    yield
    with open(os.environ.get("BUSY_LOG", "busy-log.jsonl"), "a") as log:
        log.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - wall, 2),
                              "cpu": round(machine_cpu_s() - cpu, 2)}) + "\n")
