"""Compiled steps saved whole and loaded by a later start (workers/compile/step_artifacts.py): a second
compiler loads what the first built instead of compiling it, with the same results; a corrupt file,
or one built for another model, is compiled again and replaced, never run; a graph that cannot be
built whole is compiled through torch.compile."""

from __future__ import annotations

import logging

import pytest
import torch

from warpspec.workers.compile.compiled_step import CountingCompiler
from warpspec.workers.compile.step_artifacts import StepArtifacts, graphs_built, module_identity
from warpspec.workers.compile.torch_internals import DIM_MARKINGS


class Scale(torch.nn.Module):
    def __init__(self, width: int = 16, factor: float = 2.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width, generator=torch.Generator().manual_seed(0)),
                                         requires_grad=False)
        self.factor = factor

    def step(self, x):
        return (x @ self.weight) * self.factor


def broken(x):
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


def _compiler(model: Scale, folder) -> CountingCompiler:
    return CountingCompiler(model.step, StepArtifacts(module_identity(model), folder),
                            mark_dynamic=lambda args: torch._dynamo.mark_dynamic(args[0], 0))


@torch.inference_mode()
def test_a_second_compiler_loads_the_saved_graph_and_runs_it_for_every_batch(tmp_path):
    model = Scale()
    first = _compiler(model, tmp_path)
    x = torch.randn(3, 16)
    torch.testing.assert_close(first(x, graph="step"), model.step(x))
    assert (first.num_compiles, first.num_loaded) == (1, 0)
    assert len(list((tmp_path / "warpspec-steps").glob("*.bin"))) == 1
    before = graphs_built()
    second = _compiler(model, tmp_path)
    for rows in (3, 7):  # the batch stays symbolic in the saved graph
        x = torch.randn(rows, 16)
        torch.testing.assert_close(second(x, graph="step"), model.step(x))
    assert (second.num_compiles, second.num_loaded) == (0, 1)
    assert graphs_built() == (before[0] + 1, before[1])
    assert second.saved_thread_count("step") == torch.get_num_threads()


@torch.inference_mode()
def test_a_corrupt_file_is_compiled_again_and_replaced(tmp_path, caplog):
    model = Scale()
    _compiler(model, tmp_path)(torch.randn(2, 16), graph="step")
    [saved] = (tmp_path / "warpspec-steps").glob("*.bin")
    saved.write_bytes(saved.read_bytes()[:1000])
    again = _compiler(model, tmp_path)
    x = torch.randn(4, 16)
    with caplog.at_level(logging.INFO, logger="warpspec.workers.compile.step_artifacts"):
        torch.testing.assert_close(again(x, graph="step"), model.step(x))
    assert (again.num_compiles, again.num_loaded) == (1, 0)
    assert "does not load" in caplog.text and saved.name in caplog.text
    assert _compiler(model, tmp_path)(x, graph="step") is not None  # the replacement loads
    assert saved.stat().st_size > 1000


@torch.inference_mode()
def test_a_graph_built_for_another_model_fails_its_guards_and_is_compiled_again(tmp_path, caplog):
    """Same name (the identity is the caller's: here one that cannot tell the models apart), another
    constant: the saved graph's guards refuse the new model, and it is built for it."""
    _compiler_for = lambda model: CountingCompiler(model.step, StepArtifacts("one name", tmp_path))  # noqa: E731
    x = torch.randn(2, 16)
    _compiler_for(Scale(factor=2.0))(x, graph="step")
    other = Scale(factor=3.0)
    compiled = _compiler_for(other)
    with caplog.at_level(logging.INFO, logger="warpspec.workers.compile.step_artifacts"):
        torch.testing.assert_close(compiled(x, graph="step"), other.step(x))
    assert (compiled.num_compiles, compiled.num_loaded) == (1, 0)
    # The log names the guard (read through dynamo's private guard manager: this fails if it moves).
    assert "its guards fail" in caplog.text and "factor" in caplog.text and "reason unknown" not in caplog.text


class Cached(torch.nn.Module):
    """Reads rows of a cache that is an attribute, not an argument, as attention reads its KV cache."""

    def __init__(self, rows: int):
        super().__init__()
        self.cache = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)

    def step(self, index):
        return self.cache[index] * 2


@torch.inference_mode()
def test_a_graph_built_for_one_cache_size_loads_for_another(tmp_path, caplog):
    """The cache's row count (a KV cache's block count follows the memory free at start-up) stays
    symbolic: a start that finds another amount loads the saved graph instead of building it again."""
    def compiler(model: Cached) -> CountingCompiler:
        return CountingCompiler(model.step, StepArtifacts("cached", tmp_path), dynamic_state=((model.cache, 0),))

    index = torch.tensor([0, 2])
    small = Cached(5)
    torch.testing.assert_close(compiler(small)(index, graph="step"), small.step(index))
    large = Cached(9)
    compiled = compiler(large)
    with caplog.at_level(logging.INFO, logger="warpspec.workers.compile.step_artifacts"):
        index = torch.tensor([8, 1])
        torch.testing.assert_close(compiled(index, graph="step"), large.step(index))
    assert (compiled.num_compiles, compiled.num_loaded) == (0, 1), caplog.text
    # Unmarked: a later load would refuse a marked one.
    assert not (set(vars(small.cache)) | set(vars(large.cache))) & set(DIM_MARKINGS)


def test_models_of_other_shapes_have_other_identities():
    assert module_identity(Scale(16)) != module_identity(Scale(8))
    assert module_identity(Scale(16)) == module_identity(Scale(16, factor=5.0))  # the guards tell these apart


def test_a_graph_with_a_break_is_compiled_through_torch_compile_saying_why(tmp_path, caplog):
    compiled = CountingCompiler(broken, StepArtifacts("broken", tmp_path))
    x = torch.randn(4)
    with caplog.at_level(logging.INFO, logger="warpspec.workers.compile.compiled_step"):
        torch.testing.assert_close(compiled(x, graph="step"), (x + 1) * 2)
    assert "cannot be compiled whole" in caplog.text and "step" in compiled.traced_graphs
    assert compiled.num_compiles == 2 and not compiled.whole_graphs  # the two halves, by dynamo
    assert not list((tmp_path / "warpspec-steps").glob("*.bin"))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_file_names_the_thread_count_it_was_built_with(tmp_path, threads):
    artifacts = StepArtifacts("x", tmp_path)
    path = artifacts.path("f", "step", threads)
    assert path.name.endswith(f"-t{threads}.bin")
    assert artifacts.saved_threads("f", "step") is None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    assert artifacts.saved_threads("f", "step") == threads
