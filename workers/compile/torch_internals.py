"""The private torch APIs warpspec uses, in one place, each with why no public API serves.

Checked against torch 2.13.0 (TORCH_CHECKED). tests/workers/compile/test_torch_internals.py calls each one on
the installed torch and fails, naming it, when an upgrade moves or changes it.

- inductor's default cache folder (torch._inductor.runtime.cache_dir_utils.default_cache_dir):
  inductor writes it into TORCHINDUCTOR_CACHE_DIR itself once anything has compiled, and
  open_compile_cache (compile_cache.py) must tell that from a folder a user named.
- inductor's FX-graph cache counters (torch._dynamo.utils.counters["inductor"]): how many graphs a
  start-up loaded from the compile cache and how many it compiled. torch.compiler exports no count.
- inductor as a function (torch._inductor.compile_fx.compile_fx): a backend that counts the graphs
  it builds has to call inductor itself; torch.compile(backend="inductor") counts nothing.
- dynamo's cache entries for a code object (torch._dynamo.eval_frame._debug_get_cache_entry_list,
  each with .code and .guard_manager.check): the code dynamo made for each graph, and the guards
  that pick it, so that a step calls its graph's code directly (compiled_step.CountingCompiler).
  torch has no public handle on a compiled graph's code; vLLM's compiled models read it the same way.
- torch._dynamo.mark_dynamic: a size to keep symbolic in a graph compiled with dynamic=False. It is
  the documented way (torch.compile's dynamic-shapes guide), but torch.compiler does not export it.
- unmarking a size (deleting the attributes torch._dynamo.mark_dynamic sets on a tensor,
  DIM_MARKINGS): a tensor a step reads from its module, not from its arguments (the KV cache), keeps
  a marking for life, and a saved graph's guards refuse a tensor still marked when it loads ("present
  on runtime tensor but was absent at compile time"), even one marked the same way when it was built.
  torch has no call that undoes mark_dynamic.
- duck shaping off (torch.fx.experimental._config.use_duck_shape, the switch dynamo's own
  specialization message names): with it on, sizes equal at the first compile share one symbol, and
  a size a weight fixes fixes every size equal to it. torch.compile takes no option for it.
- a saved graph's failing guard (AOTCompiledFunction.prepare_f_locals and its guard manager's
  check_verbose): the log says which guard refused a saved step graph; the AOT API returns only a
  bool.
- inductor's CPU instruction-set probe (torch._inductor.cpu_vec_isa: x86_isa_checker,
  supported_vec_isa_list, valid_vec_isa_list; the config switch cpp.vec_isa_ok; and
  cpp_builder.get_cpp_compiler; inductor's config.patch to set the switch around a load, and
  compile_threads=1 in a compile helper, itself one of a start's parallel builds): which
  sets the CPU lists, which the probe found usable, and the compiler it builds with, so that a host
  probes once (vec_isa.py). torch exposes only the switch, as TORCHINDUCTOR_VEC_ISA_OK for a whole
  process.
- the compiler stance in force (torch._dynamo.eval_frame._stance): a graph saved whole is called as
  a plain function, which `torch.compiler.set_stance("force_eager")` does not reach; its caller
  (compiled_step.CountingCompiler) runs eagerly under that stance itself, as the thread-count timing
  asks. torch.compiler sets the stance but has no getter.

Left outside: kernels/fp8.py calls torch._scaled_mm on FP8 GPUs (the kernels import nothing above
them). torch 2.13 has a public torch.nn.functional.scaled_mm; moving to it wants a GPU to check.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

TORCH_CHECKED = "2.13.0"


def inductor_default_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def listed_vec_isas() -> list[str]:
    """The vector instruction sets inductor knows that the CPU lists (x86: /proc/cpuinfo's flags, as
    inductor reads them), without building anything; [] on other machines, where inductor probes
    nothing. Not bool() on each set: a set caches its answer for the process whatever the switch
    (VEC_ISA_SWITCH) said then, so asking would stand in for the probe."""
    import platform

    from torch._inductor import cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def usable_vec_isas() -> list[str]:
    """The vector instruction sets inductor picks from in this process: after its probe, those whose
    program built and loaded."""
    from torch._inductor import cpu_vec_isa

    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


# Inductor's switch that takes every instruction set the CPU lists as buildable, skipping the probe
# (TORCHINDUCTOR_VEC_ISA_OK), as a config patch.
VEC_ISA_SWITCH = "cpp.vec_isa_ok"


@contextlib.contextmanager
def inductor_config_patched(patches: dict) -> Iterator[None]:
    """Inductor's config with patches inside (what a compile's options= does), for work that takes no
    options: loading a saved graph."""
    from torch._inductor import config

    with config.patch(patches):
        yield


def cpp_compiler() -> str:
    """The C++ compiler inductor builds with."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def fx_graph_cache_counts() -> tuple[int, int]:
    """(graphs inductor loaded from its cache, graphs it compiled) in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def compile_with_inductor(graph_module, example_inputs, config_patches: dict):
    """What torch.compile's inductor backend does with a graph dynamo captured, with config_patches."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph_module, example_inputs, config_patches=config_patches)


def mark_dynamic(tensor, dim: int) -> None:
    import torch._dynamo

    torch._dynamo.mark_dynamic(tensor, dim)


# What torch._dynamo.mark_dynamic sets on a tensor (torch/_dynamo/decorators.py).
DIM_MARKINGS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides", "_specialize_on",
                "_has_dynamo_dim_marking")


@contextlib.contextmanager
def marked_dynamic(sizes: tuple[tuple[object, int], ...]) -> Iterator[None]:
    """Each (tensor, dim) in sizes marked dynamic inside, and unmarked after: for tensors a graph
    reads besides its arguments, whose guards would otherwise refuse them at a later load."""
    for tensor, dim in sizes:
        mark_dynamic(tensor, dim)
    try:
        yield
    finally:
        for tensor, _ in sizes:
            for name in DIM_MARKINGS:
                if hasattr(tensor, name):
                    delattr(tensor, name)


@dataclass
class CachedGraph:
    code: types.CodeType  # dynamo's code for the frame: guards passed, it runs the graph
    guards_pass: Callable[[dict], bool]  # called with the frame's locals by name


def cached_graphs(code: types.CodeType) -> list[CachedGraph] | None:
    """The graphs dynamo holds for code, newest first; None on a torch without the cache-entry API."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    return [CachedGraph(entry.code, entry.guard_manager.check) for entry in _debug_get_cache_entry_list(code)]


@contextlib.contextmanager
def without_duck_shapes() -> Iterator[None]:
    """Graphs dynamo traces inside give every size its own symbol."""
    from torch.fx.experimental import _config

    with _config.patch(use_duck_shape=False):
        yield


def forcing_eager() -> bool:
    """Whether torch.compiler.set_stance("force_eager") is in force."""
    from torch._dynamo import eval_frame

    return eval_frame._stance.stance == "force_eager"


def failed_guard(compiled, args: tuple) -> str:
    """The guards of a loaded AOT-compiled function (torch.compiler.load_compiled_function) that
    args fail, as dynamo words them."""
    f_locals = compiled.prepare_f_locals(*args)
    return str(compiled._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)
