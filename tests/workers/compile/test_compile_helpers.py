"""A cold start's graphs built in forked helpers (workers/compile/compile_helpers.py): a helper's graph is
saved, loaded by the start and counted as compiled by it, and runs as the eager step does; a helper
that fails, or hangs and is stopped, leaves its graph to the start; a helper computes with OpenMP
although its parent did; the helper count and its bad values."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from warpspec.workers.compile import compile_helpers, step_artifacts
from warpspec.workers.compile.compile_helpers import ENV, build_in_helpers, helper_count
from warpspec.workers.compile.compiled_step import CountingCompiler
from warpspec.workers.compile.step_artifacts import StepArtifacts, graphs_built, module_identity


class Scale(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width, generator=torch.Generator().manual_seed(0)),
                                         requires_grad=False)

    def step(self, x):
        return torch.relu(x @ self.weight) * 2


@torch.inference_mode()
def _build(compiler: CountingCompiler, x: torch.Tensor, graph: str, fail_in_helper_of: int | None = None,
           hang_in_helper_of: int | None = None) -> None:
    """A build as a start hands it out: in inference mode (the helper's thread is a new one)."""
    if fail_in_helper_of is not None and os.getpid() != fail_in_helper_of:
        raise RuntimeError("this helper fails")
    if hang_in_helper_of is not None and os.getpid() != hang_in_helper_of:
        time.sleep(600)
    compiler.build(x, graph=graph)


def _two_graphs(tmp_path, **build_kwargs):
    model = Scale()
    compiler = CountingCompiler(model.step, StepArtifacts(module_identity(model), tmp_path))
    inputs = {"one": torch.randn(1, 16), "three": torch.randn(3, 16)}  # sizes specialized: two graphs
    builds = [functools.partial(_build, compiler, x, graph, **build_kwargs) for graph, x in inputs.items()]
    return model, compiler, inputs, builds


def test_a_helper_builds_a_graph_the_start_loads_counts_as_compiled_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    model, compiler, inputs, builds = _two_graphs(tmp_path)
    before = graphs_built()
    assert build_in_helpers(builds, "test") == 1
    # One build each (whichever each took first); both files are there, one of them a helper's.
    assert compiler.num_compiles == 1 and len(compiler.whole_graphs) == 1
    [by_helper] = step_artifacts.built_by_helpers & {str(p) for p in (tmp_path / "warpspec-steps").glob("*.bin")}
    assert len(list((tmp_path / "warpspec-steps").glob("*.bin"))) == 2
    with torch.inference_mode():
        for graph, x in inputs.items():
            torch.testing.assert_close(compiler(x, graph=graph), model.step(x))
    # The start compiled both graphs, one in a helper; it loaded none that an earlier start built.
    assert (compiler.num_compiles, compiler.num_loaded) == (2, 0)
    assert graphs_built() == (before[0], before[1] + 2)
    assert by_helper not in step_artifacts.built_by_helpers  # a later start's load of it is a load


def test_a_helper_that_fails_leaves_its_graph_to_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    model, compiler, inputs, builds = _two_graphs(tmp_path, fail_in_helper_of=os.getpid())
    assert build_in_helpers(builds, "test") == 1
    with torch.inference_mode():
        for graph, x in inputs.items():
            torch.testing.assert_close(compiler(x, graph=graph), model.step(x))
    assert (compiler.num_compiles, compiler.num_loaded) == (2, 0)


def test_a_helper_that_hangs_is_stopped_and_its_graph_left_to_the_start(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(compile_helpers, "HELPER_GRACE_S", 1.0)
    monkeypatch.setattr(compile_helpers, "GRACE_BUILDS", 0)
    model, compiler, inputs, builds = _two_graphs(tmp_path, hang_in_helper_of=os.getpid())
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="warpspec.workers.compile.compile_helpers"):
        assert build_in_helpers(builds, "test") == 1
    assert time.monotonic() - began < 60  # not the helper's 600 s
    assert "stopping it" in caplog.text
    with torch.inference_mode():
        for graph, x in inputs.items():
            torch.testing.assert_close(compiler(x, graph=graph), model.step(x))
    assert (compiler.num_compiles, compiler.num_loaded) == (2, 0)


def test_without_helpers_nothing_is_built_before_the_start_does_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    _, compiler, _, builds = _two_graphs(tmp_path)
    assert build_in_helpers(builds, "test") == 0
    assert compiler.num_compiles == 0 and not (tmp_path / "warpspec-steps").exists()


FORK_AFTER_OPENMP = """
import os, sys, functools, torch
from warpspec.workers.compile.compile_helpers import build_in_helpers
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
for _ in range(3):
    a @ a  # this thread now holds an OpenMP pool
def build(i):
    if os.getpid() != parent:
        (a @ a).sum()  # a parallel region in the helper
        torch.randn(4_000_000).exp().sum()
parent = os.getpid()
print(build_in_helpers([functools.partial(build, i) for i in range(2)], "test"))
"""


def test_a_helper_computes_with_openmp_after_its_parent_did(tmp_path):
    """Forked from the thread that ran OpenMP regions, a helper hung in its first one (the module
    docstring); forked from a new thread, it runs it. In a process of its own, so a hang fails."""
    env = {**os.environ, ENV: "1", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run([sys.executable, "-c", FORK_AFTER_OPENMP], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "1"


def test_the_helper_count_follows_the_threads_and_the_builds(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    threads = torch.get_num_threads()
    assert helper_count(1) == 0  # one build: the start builds it
    assert helper_count(100) == threads - 1  # the engine's cores, itself one of the builders
    monkeypatch.setenv(ENV, "3")
    assert helper_count(2) == 1 and helper_count(10) == 3


@pytest.mark.parametrize(("value", "says"), [("two", "whole number"), ("-1", "0 or more")])
def test_a_bad_helper_count_names_the_variable(monkeypatch, value, says):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"{ENV}.*{says}"):
        helper_count(4)
