"""Each private torch API of workers/compile/torch_internals.py still does what warpspec relies on, on the
installed torch: an upgrade that moves or changes one fails here, by name, not deep in a step."""

import contextlib
import os
import shutil

import torch

from warpspec.workers.compile import torch_internals
from warpspec.workers.compile.torch_internals import (
    cached_graphs,
    compile_with_inductor,
    failed_guard,
    fx_graph_cache_counts,
    inductor_default_cache_dir,
    mark_dynamic,
    marked_dynamic,
    without_duck_shapes,
)


def affine(x):
    return x * 2 + 1


def compiled_affine(compile_graph) -> tuple:
    """(affine on a code object of its own, compiled through a backend that counts its graphs, the
    graphs built, the function): the graphs of `affine` elsewhere in the process do not count."""
    fn = type(affine)(affine.__code__.replace(), affine.__globals__, "affine")
    built = []

    def backend(graph_module, example_inputs):
        built.append(graph_module)
        return compile_graph(graph_module, example_inputs)

    return torch.compile(fn, backend=backend, dynamic=False), built, fn


def test_inductor_names_its_default_cache_folder():
    folder = inductor_default_cache_dir()
    assert isinstance(folder, str) and os.path.isabs(folder), folder


def test_inductor_compiles_as_a_function_and_dynamo_shows_the_graphs_code_and_guards(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    hits, misses = fx_graph_cache_counts()
    compiled, built, fn = compiled_affine(lambda graph, inputs: compile_with_inductor(graph, inputs, {}))
    x = torch.arange(4.0)
    assert torch.equal(compiled(x), affine(x)) and len(built) == 1
    assert fx_graph_cache_counts() == (hits, misses + 1)  # an empty cache folder: compiled
    again, _, _ = compiled_affine(lambda graph, inputs: compile_with_inductor(graph, inputs, {}))
    assert torch.equal(again(x), affine(x)) and fx_graph_cache_counts() == (hits + 1, misses + 1)  # loaded

    graphs = cached_graphs(fn.__code__)
    assert graphs is not None, f"torch {torch.__version__} lacks dynamo's cache-entry API " \
                               f"(checked against {torch_internals.TORCH_CHECKED})"
    assert len(graphs) == 1
    (graph,) = graphs
    assert graph.guards_pass({"x": torch.zeros(4)}) and not graph.guards_pass({"x": torch.zeros(5)})
    # Dynamo's code for the frame, called like fn, runs the compiled graph.
    direct = type(fn)(graph.code, fn.__globals__, "affine", None, None)
    assert torch.equal(direct(torch.ones(4)), affine(torch.ones(4)))


def test_a_size_marked_dynamic_serves_every_length_from_one_graph():
    # The traced graph runs as it is: only the count matters here.
    compiled, built, _ = compiled_affine(lambda graph, inputs: graph.forward)
    for length in (3, 6):
        x = torch.arange(float(length))
        mark_dynamic(x, 0)
        assert torch.equal(compiled(x), affine(x))
    assert len(built) == 1, f"{len(built)} graphs for 2 lengths: mark_dynamic no longer keeps the size symbolic"


def test_a_size_marked_for_a_while_leaves_no_marking_behind():
    # Every attribute mark_dynamic sets is one marked_dynamic removes: a new one would stay on a KV
    # cache and make the guards of every saved step graph refuse it.
    plain, marked = torch.zeros(3, 4), torch.zeros(3, 4)
    mark_dynamic(marked, 0)
    added = set(vars(marked)) - set(vars(plain))
    assert added and added <= set(torch_internals.DIM_MARKINGS), added - set(torch_internals.DIM_MARKINGS)
    cache = torch.zeros(3, 4)
    with marked_dynamic(((cache, 0),)):
        assert set(vars(cache)) == added
    assert not vars(cache)


def _symbols_of_a_pair(duck: bool) -> set[str]:
    """The size symbols dynamo gives two tensors of equal size, compiled with dynamic shapes."""
    seen = []

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.find_nodes(op="placeholder"):
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                seen.extend(str(size) for size in value.shape)
        return graph_module.forward

    def pair(x, y):
        return x.sum() + y.sum()

    compiled = torch.compile(type(pair)(pair.__code__.replace(), globals(), "pair"), backend=backend, dynamic=True)
    with contextlib.nullcontext() if duck else without_duck_shapes():
        compiled(torch.ones(4), torch.ones(4))
    return set(seen)


def test_duck_shaping_can_be_turned_off_for_a_trace():
    ducked, apart = _symbols_of_a_pair(duck=True), _symbols_of_a_pair(duck=False)
    assert not any(size.isdigit() for size in ducked | apart), (ducked, apart)  # both symbolic
    assert len(ducked) == 1 and len(apart) == 2  # on by default: equal sizes, one symbol


def test_a_compiled_functions_failing_guard_is_named():
    compiled = torch.compile(affine, fullgraph=True, dynamic=False).aot_compile(((torch.zeros(4),), {}))
    assert compiled.guard_check(torch.zeros(4)) and not compiled.guard_check(torch.zeros(5))
    reason = failed_guard(compiled, (torch.zeros(5),))
    assert "x" in reason and "size" in reason.lower(), reason


def test_the_force_eager_stance_is_seen():
    assert not torch_internals.forcing_eager()
    with torch.compiler.set_stance("force_eager"):
        assert torch_internals.forcing_eager()
    assert not torch_internals.forcing_eager()


def test_inductors_instruction_set_probe_and_its_switch():
    from torch._inductor import config

    listed = torch_internals.listed_vec_isas()  # read from /proc/cpuinfo, nothing built
    assert isinstance(listed, list) and all(isinstance(name, str) for name in listed), listed
    usable = torch_internals.usable_vec_isas()  # the probe (or this process's answer to it)
    assert set(usable) <= set(listed), (usable, listed)
    assert shutil.which(torch_internals.cpp_compiler()), torch_internals.cpp_compiler()
    before = config.cpp.vec_isa_ok
    with torch_internals.inductor_config_patched({torch_internals.VEC_ISA_SWITCH: True}):
        assert config.cpp.vec_isa_ok is True
    assert config.cpp.vec_isa_ok == before


def test_inductors_compile_workers_can_be_turned_off_for_a_while():
    """A compile helper (compile_helpers.py) builds in its own process, with no pool of its own."""
    from torch._inductor.async_compile import get_compile_threads

    before = get_compile_threads()
    with torch_internals.inductor_config_patched({"compile_threads": 1}):
        assert get_compile_threads() == 1
    assert get_compile_threads() == before
