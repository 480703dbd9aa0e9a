"""What a drafter that runs a model needs besides the model: compiled functions that fall back to
eager ones, the step graphs' thread counts and their build before the first request (DraftGraphs),
and scratch blocks for the KV a draft writes past a request's block table (tables_with_scratch,
scratch_reserve). EAGLE-3 (eagle3.py) uses all of it; another draft model (an MTP head, say) would
bring its forward functions and reuse the rest.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Hashable

import torch
from tqdm import tqdm

from warpspec.workers.compile.compile_helpers import build_in_helpers
from warpspec.workers.compile.compiled_step import CountingCompiler
from warpspec.workers.compile.cpu_threads import fastest_thread_count, graph_thread_count, torch_threads
from warpspec.workers.compile.torch_internals import mark_dynamic, without_duck_shapes

# A step graph's key: (its query length or a name, whether it runs one request).
GraphKey = tuple[int | str, bool]
# A graph to build at start-up: (its key, its compiled and its eager function, arguments to build it with).
GraphToBuild = tuple[GraphKey, "CompiledWithFallback", Callable[..., object], tuple[torch.Tensor, ...]]


def dense_half_graph(args: tuple[torch.Tensor, ...]) -> tuple:
    """The key of a dense half's saved graph: what it specializes on besides the weights its name
    holds. Each argument's sizes after the first and its dtype (before_attention's features are the
    target's three layers or the draft's own output, and it branches on which), and whether it runs
    one row: the graph for two or more keeps the row count symbolic, and one row is a size torch
    specializes on, so that call gets a graph of its own."""
    return tuple((tuple(t.shape[1:]), str(t.dtype)) for t in args), args[0].shape[0] == 1


def mark_rows_dynamic(args: tuple[torch.Tensor, ...]) -> None:
    """A dense half's CountingCompiler mark_dynamic: the token count, its arguments' first size."""
    for tensor in args:
        if tensor.shape[0] > 1:
            mark_dynamic(tensor, 0)


class CompiledWithFallback:
    """torch.compile of a tensors-in, tensors-out function; if compiling or running the compiled
    code fails, warn once and run the function eagerly from then on."""

    def __init__(self, fn, name: str, compiled=None, graph_of: Callable[[tuple], Hashable] | None = None):
        """compiled: fn compiled another way than with dynamic shapes throughout. With dynamic
        shapes, duck shaping is off: the warm-up's token count (2 catch-ups) can equal a size the
        weights fix (head_dim / 2 for the rotary table), and sharing its symbol fixed the count, so
        the first prompt of another length compiled on the request path. graph_of: the graph key of
        a call made without one (a dense half's, whose compiler marks its rows dynamic), traced
        without duck shapes for the same reason."""
        self.eager, self.name = fn, name
        self.compiled = compiled or torch.compile(fn, dynamic=True)
        self.graph_of = graph_of
        self.tracing = contextlib.nullcontext if compiled is not None and graph_of is None else without_duck_shapes
        self.failed = False

    def __call__(self, *args: torch.Tensor, graph: Hashable | None = None):
        """graph: the key of the step's graph, for a CountingCompiler (its direct calls). Inside a
        graph being compiled (a whole draft step) fn is traced as it is: a saved step graph's guards
        would otherwise hold this torch.compile, which does not pickle (workers/compile/step_artifacts.py)."""
        if torch.compiler.is_compiling():
            return self.eager(*args)
        if graph is None and self.graph_of is not None:
            graph = self.graph_of(args)
        if not self.failed:
            try:
                with self.tracing():
                    return self.compiled(*args) if graph is None else self.compiled(*args, graph=graph)
            except Exception as error:  # noqa: BLE001 - any compiler failure means: run eagerly
                warnings.warn(f"torch.compile of {self.name} failed ({type(error).__name__}: {error}); "
                              "running it eagerly", stacklevel=2)
                self.failed = True
        return self.eager(*args)


class DraftGraphs:
    """A draft's compiled step graphs: the thread count each runs with, and their build before the
    first request."""

    def __init__(self):
        # graph key -> the thread count it runs with (workers/compile/cpu_threads.py).
        self.thread_counts: dict[GraphKey, int] = {}

    def run(self, compiled: CompiledWithFallback, inputs: tuple[torch.Tensor, ...], graph: GraphKey):
        with torch_threads(self.thread_counts.get(graph, torch.get_num_threads())):
            return compiled(*inputs, graph=graph)

    def warm_up(self, graphs: list[GraphToBuild], warm_up_prompt: Callable[[], None],
                first: Callable[[GraphKey], object]) -> None:
        """Choose each graph's thread count first, since a graph guards on the count it was built
        with (workers/cpu_threads.graph_thread_count, as the target's); build what the compile cache
        lacks several at once in helper processes (workers/compile/compile_helpers.py), warm_up_prompt (the
        dense halves a prompt runs) with them, the graphs that first(key) sorts first starting
        first; then run each graph and the prompt in this process."""
        for graph, compiled, eager, inputs in graphs:
            self.thread_counts[graph] = graph_thread_count(
                1 if graph[1] else 2, compiled.compiled.saved_thread_count(graph),
                lambda eager=eager, inputs=inputs: fastest_thread_count(lambda: eager(*inputs)))
        missing = [functools.partial(self._build, compiled.compiled, inputs, graph)
                   for graph, compiled, _, inputs in sorted(graphs, key=lambda entry: first(entry[0]))
                   if not self._is_saved(compiled.compiled, graph)]
        if missing:
            build_in_helpers([*missing, warm_up_prompt], "compiling the draft's steps")
        for graph, compiled, _, inputs in tqdm(graphs, desc="compiling the draft's steps", unit="graph",
                                               disable=None, leave=False):
            self.run(compiled, inputs, graph)
        warm_up_prompt()

    @torch.inference_mode()
    def _build(self, compiler: CountingCompiler, inputs: tuple[torch.Tensor, ...], graph: GraphKey) -> None:
        with torch_threads(self.thread_counts[graph]):
            compiler.build(*inputs, graph=graph)

    def _is_saved(self, compiler: CountingCompiler, graph: GraphKey) -> bool:
        with torch_threads(self.thread_counts[graph]):
            return compiler.is_saved(graph)


def scratch_reserve(max_num_seqs: int, num_speculative_tokens: int, block_size: int) -> int:
    """Scratch blocks that a step of max_num_seqs requests can need (tables_with_scratch), with a spare
    one: a request's draft steps and padded catch-up write at most 2k + 1 positions past its table."""
    return max_num_seqs * (-(-(2 * num_speculative_tokens + 1) // block_size) + 1) + 1


def tables_with_scratch(block_tables: list[list[int]], last_positions: list[int], first_scratch: int,
                        block_size: int) -> tuple[list[list[int]], int]:
    """Each block table extended with scratch blocks, numbered from first_scratch, up to the block of
    its last position; and the first block after them. Tables [[3], [4, 5]] with blocks of 4, last
    positions 9 and 5, first_scratch 10 -> [[3, 10, 11], [4, 5]], 12."""
    tables, next_scratch = [], first_scratch
    for table, last in zip(block_tables, last_positions, strict=True):
        extra = max(0, last // block_size + 1 - len(table))
        tables.append(table + list(range(next_scratch, next_scratch + extra)))
        next_scratch += extra
    return tables, next_scratch


def with_blocks(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache [2, blocks, ...], or a copy grown to num_blocks when it holds fewer: the draft's KV cache
    grows to the largest batch of drafts seen, then stays. Its block count is marked dynamic, so the
    compiled steps are not built again at every growth."""
    if num_blocks <= cache.shape[1]:
        return cache
    # Outside inference mode, like the first cache: the compiled steps guard on the kind of tensor.
    with torch.inference_mode(False):
        grown = cache.new_zeros(cache.shape[0], num_blocks, *cache.shape[2:])
        grown[:, : cache.shape[1]] = cache
    mark_dynamic(grown, 1)
    return grown
