"""A pytest plugin that logs every compiled step graph the test process builds whole (StepArtifacts.compile,
the cold path of a start) with the test that built it and the seconds it took, one JSON line each, to
$COMPILE_LOG (default compile-log.jsonl). Graphs built in Ray actors or subprocesses are not seen.

    PYTHONPATH=benchmarks/results python -m pytest -p 2026-12-06-suite-compile-log ...
"""

import json
import os
import time

import pytest

CURRENT: dict[str, str | None] = {"test": None}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    CURRENT["test"] = item.nodeid


def pytest_configure(config):
    from warpspec.workers.compile import step_artifacts

    log = open(os.environ.get("COMPILE_LOG", "compile-log.jsonl"), "a")  # noqa: SIM115 - open for the session
    compile_whole = step_artifacts.StepArtifacts.compile

    def logged(self, fn, args, inductor_options, path):
        start = time.perf_counter()
        try:
            return compile_whole(self, fn, args, inductor_options, path)
        finally:
            log.write(json.dumps({"test": CURRENT["test"], "fn": getattr(fn, "__qualname__", repr(fn)),
                                  "file": path.name, "seconds": round(time.perf_counter() - start, 2)}) + "\n")
            log.flush()

    step_artifacts.StepArtifacts.compile = logged
