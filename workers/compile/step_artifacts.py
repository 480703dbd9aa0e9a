"""Compiled step graphs saved whole, so that a later start loads each in milliseconds instead of
tracing it again.

Through torch.compile, a start whose inductor folder already holds a graph still runs dynamo's trace
and AOTAutograd before inductor finds its cached code: 19.4 s for the bundled target's 4 graphs and
12.7 s for the draft's 8 on 2 cores (a warm `warpspec serve` with the draft), about 5 s a graph.
torch's AOT precompile (`torch.compile(...).aot_compile`, `save_compiled_function`,
`torch.compiler.load_compiled_function`) keeps the traced function, its guards and inductor's
compiled graph in one file: loading the bundled target's decode graph took 0.09 s once torch's
compile machinery was imported (2.5 s for the first graph of a process), against ~5 s. The file
holds the generated C++ but not the built library: with the library in the inductor folder the load
is that fast; without it inductor builds the library again (19 s), which is why the file lives in
the inductor folder, and travels with it (compile_cache.py).

What decides whether a saved graph is used:
- its name: a digest of torch's version, the source of the code the steps run (warpspec's workers,
  kernels and spec_decode packages), the step function, the owner's identity (its model's parameter
  shapes and config) and the graph's key, then the thread count it was built with. A start runs
  each graph with the count of its saved build, if there is one, instead of timing the counts
  again (cpu_threads.py): the timing is noisy, and another count would be another build;
- then its own guards, checked on the first call's arguments: they hold every size, dtype and
  constant the graph was specialized on, and the thread count and inference mode. A graph whose
  guards fail is compiled again and its file replaced, with the reason in the log.
A graph that cannot be built this way (a graph break) says why in the log, and its owner compiles
it through torch.compile as before. A graph built but not saved says why in a warning. A rank of
several saves its own graphs: they reach its communicator, which pickles its numbers only (rank,
world size, and the group id its collectives carry, which the guards check). A cold start may build
its missing graphs in helper processes first (compile_helpers.py) and load their files here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from warpspec.workers.compile.torch_internals import failed_guard, fx_graph_cache_counts, inductor_default_cache_dir

logger = logging.getLogger(__name__)

FOLDER = "warpspec-steps"  # under the inductor folder
# The packages whose code a compiled step runs: a change to any of them makes every saved graph stale.
STEP_SOURCE_PACKAGES = ("warpspec.workers", "warpspec.kernels", "warpspec.spec_decode")


# Graphs this process compiled whole and loaded (graphs_built); inductor's FX-graph counters see neither.
_built = {"compiled": 0, "loaded": 0}
saved_here: list[str] = []  # the files this process saved, in order (a compile helper reports its own)
# Files that helpers of this process built for its start (compile_helpers.py): their first load here
# counts as a graph compiled, not loaded.
built_by_helpers: set[str] = set()


def graphs_built() -> tuple[int, int]:
    """(graphs this process loaded from the compile cache, graphs it compiled) so far: saved graphs
    loaded and compiled whole, and those torch.compile built (inductor's cache hits and misses)."""
    hits, misses = fx_graph_cache_counts()
    return hits + _built["loaded"], misses + _built["compiled"]


@functools.cache
def source_digest() -> str:
    """SHA-256 of the source files of STEP_SOURCE_PACKAGES (found without importing them)."""
    digest = hashlib.sha256()
    for package in STEP_SOURCE_PACKAGES:
        spec = importlib.util.find_spec(package)
        for folder in spec.submodule_search_locations if spec is not None else ():
            for path in sorted(Path(folder).rglob("*.py")):
                digest.update(path.relative_to(folder).as_posix().encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def module_identity(module: torch.nn.Module | None) -> str:
    """What tells one model's steps from another's in one folder: every parameter and buffer's name,
    shape and dtype, and the model's config (nothing for a model not yet there)."""
    digest = hashlib.sha256(repr(getattr(module, "config", None)).encode())
    tensors = [*module.named_parameters(), *module.named_buffers()] if module is not None else []
    for name, tensor in tensors:
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
    return digest.hexdigest()


class StepArtifacts:
    """The saved graphs of one owner (a model's step runner, a draft's proposer), in the inductor
    folder of this process (compile_cache.open_compile_cache points it at the compile cache)."""

    def __init__(self, identity: str, folder: str | Path | None = None, check_guards: bool = True):
        """identity: what tells this owner's graphs from another's (module_identity, and any
        constant of its steps). check_guards=False loads a graph by its name alone, for an owner
        whose guards refuse every later call (see the EAGLE-3 proposer): its identity must then
        hold everything the graph was specialized on."""
        self.identity = identity
        self.check_guards = check_guards
        if folder is None:
            folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_default_cache_dir()
        self.folder = Path(folder, FOLDER)

    def path(self, fn_name: str, graph: Hashable, threads: int | None = None) -> Path:
        """The file of fn_name's graph built with `threads` threads (default: the current count)."""
        threads = torch.get_num_threads() if threads is None else threads
        return self.folder / f"{self._key(fn_name, graph)}-t{threads}.bin"

    def saved_threads(self, fn_name: str, graph: Hashable) -> int | None:
        """The thread count of the saved build of fn_name's graph that a start last used or built, if
        any: a start reuses it rather than timing the counts again (the timing is noisy, and another
        count is another build)."""
        saved = sorted(self.folder.glob(f"{self._key(fn_name, graph)}-t*.bin"), key=lambda p: p.stat().st_mtime)
        return int(saved[-1].stem.rsplit("-t", 1)[1]) if saved else None

    def _key(self, fn_name: str, graph: Hashable) -> str:
        key = "\n".join((torch.__version__, source_digest(), fn_name, self.identity, repr(graph)))
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def load(self, path: Path, args: tuple) -> tuple[Callable | None, bool]:
        """The graph saved at path, if it loads and its guards pass for args, else None, logged; and
        whether a helper of this process built it for this start (its first load only)."""
        if not path.exists():
            return None, False
        try:
            with path.open("rb") as f:
                compiled = torch.compiler.load_compiled_function(f)
            if not self.check_guards or compiled.guard_check(*args):
                compiled.disable_guard_check()
                by_helper = str(path) in built_by_helpers
                built_by_helpers.discard(str(path))
                _built["compiled" if by_helper else "loaded"] += 1
                os.utime(path)  # the build last used: saved_threads
                return compiled, by_helper
            reason = f"its guards fail for this model or these inputs ({failed_guard(compiled, args)[:300]})"
        except Exception as error:  # noqa: BLE001 - a file that does not load is rebuilt, whatever the cause
            reason = f"it does not load ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]})"
        logger.info("compiled step %s is not used, %s; compiling it again", path.name, reason)
        return None, False

    def compile(self, fn: Callable, args: tuple, inductor_options: dict, path: Path) -> Callable:
        """fn compiled whole for args (sizes marked dynamic stay symbolic), saved at path. Raises what
        torch raises when fn cannot be compiled whole (a graph break)."""
        compiled = torch.compile(fn, fullgraph=True, backend="inductor", dynamic=False,
                                 options=inductor_options).aot_compile((args, {}))
        compiled.disable_guard_check()  # just built for these arguments
        _built["compiled"] += 1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))
            saved_here.append(str(path))
        except Exception as error:  # noqa: BLE001 - the graph still runs; only the next start pays again
            logger.warning("compiled step %s could not be saved (%s: %s); the next start compiles it again",
                           path.name, type(error).__name__, (str(error).splitlines() or [''])[0][:200])
        return compiled

