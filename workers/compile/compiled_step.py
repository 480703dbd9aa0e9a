"""Compiled decode and verification steps on the CPU: the CPU's counterpart of CUDA graphs.

Eagerly, a decode step of a small model is mostly PyTorch dispatch: ~25 ops per layer at 10-20 us
each, for arithmetic that takes a fraction of that. `torch.compile` (inductor's C++ code) turns the
whole forward, logits included, into a few fused loops and GEMM calls. It does so only while every
step looks alike, so a step runs compiled only when it is uniform, as for the graphs: every
sequence has the same number of new tokens (1 for decode, k+1 for verification) and wants logits
for all of them. Prefill chunks and mixed steps run eagerly; a uniform step of any batch size runs
compiled (CUDA graphs stop at the largest captured size; these graphs have no such end, and a batch
past 32 that ran eagerly decoded 23% fewer tokens per second at 64 sequences than at 32).

Shapes that would otherwise recompile the step:
- batch size and context length are symbolic (marked dynamic), so one graph serves every batch of
  two or more sequences and every context length of a query length;
- torch specializes sizes of 1, so one sequence gets a graph of its own (padding it with a second
  sequence instead measured 2.27 ms against 1.79 ms for the bundled target's decode step);
- block tables are widened to at least two blocks, for the same reason;
- the KV cache's block count is symbolic too: it follows the memory free at start-up, and graphs
  specialized on it were built again by every start that found another amount.

So a replica needs at most two graphs per (query length, captured layers). The engine builds them
when it starts (ModelRunner.warm_up), and a generation then compiles nothing (counted in
`num_compiles`; a test runs 2 x 199 decode steps). Each is compiled whole and saved in the compile
cache folder (step_artifacts.py), so that a later start loads it in a fraction of a second instead
of tracing it again; a cold start builds the graphs it lacks several at once, in helper processes
(compile_helpers.py). A graph that cannot be saved so is compiled through torch.compile. Every
graph runs with torch's thread count, but the graph for one sequence runs with fewer threads when
they ran its step clearly faster eagerly (workers/compile/cpu_threads.py: where OpenMP's threads sleep
between regions one thread wins a lone sequence's step; elsewhere the eager timing is too close to
tell, and it misjudges larger batches). The count is chosen before the graph is built: a graph
guards on the thread count, and timing the compiled step with each count would build it once per
count.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F

from warpspec.kernels import PagedAttentionMetadata
from warpspec.workers.compile.cpu_threads import torch_threads
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig, uniform_query_len
from warpspec.workers.compile.step_artifacts import StepArtifacts, module_identity
from warpspec.workers.compile.torch_internals import (
    cached_graphs,
    compile_with_inductor,
    forcing_eager,
    inductor_config_patched,
    mark_dynamic,
    marked_dynamic,
)
from warpspec.workers.compile.vec_isa import vec_isa_options
from warpspec.workers.kv_groups import KVGroupLayout
from warpspec.workers.step import SequenceStep, StepInput

logger = logging.getLogger(__name__)

MIN_BLOCKS = 2  # see the module docstring: sizes of 1 are specialized
# The step's host code in C++ as well (inductor's cpp_wrapper): the default wrapper is Python that
# allocates each buffer and calls each kernel and GEMM, ~100 calls a step. Two engines in one
# process, generations alternating, 16 pairs each: 1.15x the tokens/s of plain decoding at batch 1
# (1.10-1.26) and 1.14x with EAGLE-3 (1.06-1.26), the same tokens
# (benchmarks/results/2026-12-02-cpp-wrapper-cpu.md). It costs compile time once, cached.
INDUCTOR_PATCHES = {"cpp_wrapper": True}


def step_inductor_options() -> dict:
    """INDUCTOR_PATCHES, and the switch that skips inductor's CPU instruction-set probe on a host that
    recorded it (vec_isa.py): the same options in every process, as inductor's cache keys hold them."""
    return {**INDUCTOR_PATCHES, **vec_isa_options()}


def with_own_code(fn: Callable) -> Callable:
    """fn (a function or a bound method) with a copy of its code object. Dynamo keeps its graphs per
    code object, and stops compiling one after torch._dynamo.config.recompile_limit graphs (8),
    running it eagerly from then on with a warning. Every engine in a process compiles the same
    step functions, up to 4 graphs each: the third engine's steps would silently run eagerly (the
    test suite's did), and each engine's calls would look up every other engine's graphs."""
    return with_code(fn, getattr(fn, "__func__", fn).__code__.replace())


def with_code(fn: Callable, code: types.CodeType) -> Callable:
    """fn's function (its globals, defaults and closure) running code, bound as fn is."""
    func = getattr(fn, "__func__", fn)
    new = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    owner = getattr(fn, "__self__", None)
    return new if owner is None else types.MethodType(new, owner)


class CountedInductor:
    """The inductor backend of one CountingCompiler, counting the graphs it builds. Dynamo keeps
    every backend it was given for the life of the process (torch._dynamo.eval_frame.cached_backends),
    so this one holds its compiler weakly: holding it strongly, through the compiler's step function,
    kept every shut-down engine's model in memory."""

    def __init__(self, compiler: CountingCompiler):
        self.compiler = weakref.ref(compiler)

    def __call__(self, graph_module, example_inputs):
        compiler = self.compiler()
        if compiler is not None:
            compiler.num_compiles += 1
        return compile_with_inductor(graph_module, example_inputs, step_inductor_options())


class CountingCompiler:
    """torch.compile with inductor that counts the graphs it builds and the calls it serves (tests
    hold a generation to them). dynamic=False: only the sizes marked dynamic (mark_step_dynamic)
    stay symbolic. It compiles a copy of fn's code (with_own_code), so its graphs and its recompile
    limit are its own, whatever else in the process compiles fn.

    With `artifacts`, a call that names its graph (`graph=`, the key its owner tells its graphs apart
    by: query length, one sequence or more, the aux layers a draft reads) runs that graph compiled
    whole (torch's AOT precompile, step_artifacts.py): loaded from the folder, or compiled and saved
    there on its first call. It is called directly, as vLLM's compiled models dispatch: no frame
    hook, no cache lookup, no guard.
    The rest of this docstring is the path without artifacts, or for a graph that cannot be
    compiled whole.

    After `seal()` (its owner's warm-up ran every graph it will call), a call that names its graph
    runs the code dynamo made for that graph directly. Through torch.compile, even checking only the
    guards that tell the graphs apart (torch's skip_guard_eval_unsafe), a call cost ~0.1 ms more:
    0.93 against 0.83 ms for the bundled target's decode step, 1.25 against 1.15 for its 4-token
    verification.

    Which code: the warm-up call of each graph looks it up as dynamo does, the cached graph whose
    guards pass for that call, once. The code reads the weights of the frame it runs in, this
    instance's. A graph with a graph break is not called directly (its resumed part would run
    eagerly). Calls without a key, or before the seal, go through torch.compile: after the seal
    checking only the distinguishing guards, since every graph of its code is its own."""

    def __init__(self, fn: Callable, artifacts: StepArtifacts | None = None,
                 mark_dynamic: Callable[[tuple], None] | None = None,
                 dynamic_state: tuple[tuple[torch.Tensor, int], ...] = ()):
        """artifacts: where graphs with a key are saved and loaded whole (step_artifacts.py); None
        compiles them through torch.compile in every process. mark_dynamic: marks a call's varying
        sizes before each compile (a saved graph's guards refuse arguments marked again).
        dynamic_state: (tensor, dim) of tensors fn reads besides its arguments (a KV cache) whose
        size at dim is symbolic in every graph: marked while a graph compiles, unmarked after."""
        self.num_compiles = 0
        self.num_loaded = 0  # graphs loaded from artifacts instead of compiled
        self.num_calls = 0
        self.num_direct_calls = 0
        self.fn = with_own_code(fn)
        self.code = getattr(self.fn, "__func__", self.fn).__code__
        self.artifacts = artifacts
        self.mark_dynamic = mark_dynamic or (lambda args: None)
        self.dynamic_state = dynamic_state
        self.sealed = False
        self.direct_calls: dict[Hashable, Callable] = {}  # graph -> dynamo's code for it, called like fn
        self.whole_graphs: dict[Hashable, Callable] = {}  # graph -> its saved graph (artifacts), called like fn
        self.traced_graphs: set[Hashable] = set()  # graphs that could not be built whole: through torch.compile
        self.compiled = torch.compile(self.fn, backend=CountedInductor(self), dynamic=False)

    def __getstate__(self) -> dict:
        """Nothing: saving a graph whole pickles every object its arguments reach (dynamo's guard
        state), its owner and so this compiler among them, whose graphs cannot be pickled. The
        graph's guards never read the compiler."""
        return {}

    def seal(self) -> None:
        self.sealed = True

    def saved_thread_count(self, graph: Hashable) -> int | None:
        """The thread count graph's saved build runs with, if it has one (step_artifacts.py)."""
        if self.artifacts is None:
            return None
        return self.artifacts.saved_threads(getattr(self.fn, "__func__", self.fn).__qualname__, graph)

    def __call__(self, *args, graph: Hashable | None = None):
        self.num_calls += 1
        if forcing_eager():  # a thread-count timing (cpu_threads.py): graphs saved whole do not see the stance
            return self.fn(*args)
        whole = self.whole_graphs.get(graph)
        if whole is None and graph is not None and self.artifacts is not None and graph not in self.traced_graphs:
            whole = self._load_or_compile_whole(graph, args)
        if whole is not None:
            self.num_direct_calls += self.sealed
            return whole(*args)
        direct = self.direct_calls.get(graph) if self.sealed else None
        if direct is not None:
            self.num_direct_calls += 1
            return direct(*args)
        self.mark_dynamic(args)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if self.sealed \
                else marked_dynamic(self.dynamic_state):
            result = self.compiled(*args)
        if graph is not None and not self.sealed and graph not in self.direct_calls:
            self._keep_direct_call(graph, args)
        return result

    def _load_or_compile_whole(self, graph: Hashable, args: tuple) -> Callable | None:
        """graph's saved graph (step_artifacts.py), loaded, or compiled and saved; None when it cannot
        be compiled whole (it is then compiled through torch.compile), with the reason in the log: a
        graph break."""
        func, owner = getattr(self.fn, "__func__", self.fn), getattr(self.fn, "__self__", None)
        bound = args if owner is None else (owner, *args)
        path = self.artifacts.path(func.__qualname__, graph)
        with inductor_config_patched(vec_isa_options()):  # loading builds what the folder lacks
            compiled, by_helper = self.artifacts.load(path, bound)
        if compiled is not None:
            # A graph a helper built for this start (compile_helpers.py) is one this start compiled.
            self.num_compiles += by_helper
            self.num_loaded += not by_helper
        else:
            self.mark_dynamic(args)
            try:
                with marked_dynamic(self.dynamic_state):
                    compiled = self.artifacts.compile(func, bound, step_inductor_options(), path)
            except Exception as error:  # noqa: BLE001 - torch.compile's own path still serves it
                logger.info("%s's graph %r cannot be compiled whole (%s: %s); compiling it through "
                               "torch.compile in every start", func.__qualname__, graph, type(error).__name__,
                               (str(error).splitlines() or [''])[0][:200])
                self.traced_graphs.add(graph)
                return None
            self.num_compiles += 1
        self.whole_graphs[graph] = compiled if owner is None else functools.partial(compiled, owner)
        return self.whole_graphs[graph]

    def is_saved(self, graph: Hashable) -> bool:
        """Whether graph has a saved build for the current thread count (step_artifacts.py)."""
        func = getattr(self.fn, "__func__", self.fn)
        return self.artifacts is not None and self.artifacts.path(func.__qualname__, graph).exists()

    def build(self, *args, graph: Hashable) -> None:
        """Compile graph whole for args and save it, or load it, without running it: a cold start's
        builds, shared out among helper processes (compile_helpers.py)."""
        if graph not in self.whole_graphs and graph not in self.traced_graphs and self.artifacts is not None:
            self._load_or_compile_whole(graph, args)

    def _keep_direct_call(self, graph: Hashable, args: tuple) -> None:
        """The code of the cached graph whose guards pass for args (in the caller's global state:
        threads, inference mode), as a function called like fn, for graph's calls after the seal."""
        graphs = cached_graphs(self.code)
        if graphs is None:  # a torch without the cache-entry API: every call through torch.compile
            return
        fn, owner = getattr(self.fn, "__func__", self.fn), getattr(self.fn, "__self__", None)
        frame_locals = inspect.signature(fn).bind(*(() if owner is None else (owner,)), *args).arguments
        code = next((graph.code for graph in graphs if graph.guards_pass(dict(frame_locals))), None)
        if (code is None or any(name.startswith("__resume_at") for name in code.co_names)
                or len(code.co_freevars) != len(fn.__closure__ or ())):
            return
        self.direct_calls[graph] = with_code(self.fn, code)

    def owns_every_graph(self) -> bool:
        """Whether every graph dynamo holds for this code was built by this instance (what its own
        copy of the code guarantees; tests hold it)."""
        graphs = cached_graphs(self.code)
        return graphs is not None and len(graphs) == self.num_compiles - len(self.whole_graphs) + self.num_loaded


def widen_block_tables(block_tables: torch.Tensor) -> torch.Tensor:
    """At least MIN_BLOCKS columns; the extra one is never read, as seq_lens end before it. Always a
    new tensor: one made here (under inference mode) and one passed through would carry different
    dispatch keys, and the compiled step would recompile on the difference."""
    return F.pad(block_tables, (0, max(0, MIN_BLOCKS - block_tables.shape[-1])))


def mark_step_dynamic(per_batch: tuple[torch.Tensor, ...], block_tables: torch.Tensor, num_seqs: int) -> None:
    """Keep a step's varying sizes symbolic: each first size of per_batch ([num_tokens, ...],
    [num_seqs + 1], [num_seqs, ...]) grows with the batch, except for one sequence, whose sizes stay
    fixed; the block count grows with the context, and so does a hybrid KV cache's window tables'
    ([num_seqs, groups, blocks], the only 3-d one)."""
    if num_seqs > 1:
        for tensor in per_batch:
            mark_dynamic(tensor, 0)
    mark_dynamic(block_tables, 1)
    for tensor in per_batch:
        if tensor.dim() == 3:
            mark_dynamic(tensor, 2)


def step_marker(block_tables_at: int) -> Callable[[tuple], None]:
    """mark_step_dynamic for a uniform step's arguments: its tensors, with the block tables at
    block_tables_at and the sequence lengths just before them (CountingCompiler's mark_dynamic)."""
    def mark(args: tuple) -> None:
        tensors = tuple(arg for arg in args if isinstance(arg, torch.Tensor))
        mark_step_dynamic(tensors, args[block_tables_at], args[block_tables_at - 1].shape[0])
    return mark


class CompiledStepRunner:
    """Runs uniform steps through torch.compile'd forwards; `run` returns None for any other step.

    config: the query lengths and the longest context of the CUDA graphs; its batch sizes choose
    whether a graph for several sequences is built at all (not when the largest is 1: such steps run
    eagerly)."""

    def __init__(self, model, config: CudaGraphConfig, block_size: int, kv_layout: KVGroupLayout | None = None,
                 kv_caches: list[torch.Tensor] = ()):
        """kv_caches: the tensors model's attention writes ([2, blocks, ...]). Their block count is
        symbolic in the graphs: it follows the memory a start finds free, and a graph specialized on
        it was not loaded by the next start that found another amount (nor by another replica)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.max_blocks = -(-config.max_model_len // block_size)
        # A rank's graphs are its own: ranks of one shape share a folder on one host.
        comm = getattr(model, "comm", None)
        where = f"rank {getattr(comm, 'rank', 0)} of {getattr(comm, 'world_size', 1)} {type(comm).__name__}"
        self.compiled = CountingCompiler(self._forward, StepArtifacts(f"{module_identity(model)} {block_size} {where}"),
                                         mark_dynamic=step_marker(4),
                                         dynamic_state=tuple((cache, 1) for cache in kv_caches))
        # (query length, one sequence) -> the thread count its graph runs fastest with (set_threads)
        self.thread_counts: dict[tuple[int, bool], int] = {}

    @property
    def num_compiles(self) -> int:
        return self.compiled.num_compiles

    @property
    def num_compiled_steps(self) -> int:
        return self.compiled.num_calls

    def runs_compiled(self, step: StepInput) -> bool:
        q = uniform_query_len(step)
        if q is None or q not in self.config.query_lens:
            return False
        if step.seq_lens.shape[0] > 1 and not self.config.several_sequences:
            return False
        return step.block_tables.shape[1] <= self.max_blocks

    def run(self, step: StepInput) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """step on the host; its (logits, aux hidden), or None to run it eagerly."""
        if not self.runs_compiled(step):
            return None
        with self._threads(step):
            return self.compiled(*self._call_args(step), graph=self._saved_as(step))

    def build(self, step: StepInput) -> None:
        """Build (or load) step's graph without running it (CountingCompiler.build)."""
        with self._threads(step):
            self.compiled.build(*self._call_args(step), graph=self._saved_as(step))

    def is_saved(self, step: StepInput) -> bool:
        """Whether step's graph has a saved build for its thread count."""
        with self._threads(step):
            return self.compiled.is_saved(self._saved_as(step))

    def _threads(self, step: StepInput):
        return torch_threads(self.thread_counts.get(self._graph_of(step), torch.get_num_threads()))

    @staticmethod
    def _call_args(step: StepInput) -> tuple:
        """_forward's arguments for step: block tables widened (MIN_BLOCKS)."""
        block_tables = widen_block_tables(step.block_tables)
        window_tables = None if step.window_tables is None else widen_block_tables(step.window_tables)
        return (step.input_ids, step.positions, step.query_start_loc, step.seq_lens, block_tables,
                step.slot_mapping, step.window_starts, window_tables, step.window_slot_mapping,
                step.max_query_len, tuple(step.aux_layer_ids))

    @staticmethod
    def _graph_of(step: StepInput) -> tuple[int, bool]:
        return step.max_query_len, step.seq_lens.shape[0] == 1

    def _saved_as(self, step: StepInput) -> tuple:
        """step's graph as its saved file names it: the aux layers too, since a target serving a draft
        returns their hidden states and builds another graph (one key for both made each start
        replace the other's file); a hybrid KV cache's window tables too, for the same reason."""
        hybrid = ("hybrid",) if step.window_tables is not None else ()
        return *self._graph_of(step), tuple(step.aux_layer_ids), *hybrid

    def saved_thread_count(self, step: StepInput) -> int | None:
        return self.compiled.saved_thread_count(self._saved_as(step))

    def set_threads(self, step: StepInput, count: int) -> None:
        """Run step's graph with count threads. Set it before the graph is built: the graph guards
        on the count it was built with, and another count would build it again."""
        self.thread_counts[self._graph_of(step)] = count

    def warm_up_steps(self, aux_layer_ids: list[int]) -> list[StepInput]:
        """One step of every graph a replica needs: each query length, for one sequence and, unless
        sequences run one at a time, for two. They write into the first blocks, which no request
        holds yet (a position's KV is always written before it is read)."""
        batches = (1, 2) if self.config.several_sequences else (1,)
        return [self._warm_up_step(query_len, num_seqs, aux_layer_ids)
                for query_len in self.config.query_lens for num_seqs in batches]

    def _warm_up_step(self, query_len: int, num_seqs: int, aux_layer_ids: list[int]) -> StepInput:
        table = list(range(-(-query_len // self.block_size)))
        layout = self.kv_layout
        windows = [table] * layout.num_window_groups if layout is not None else []
        seqs = [SequenceStep([0] * query_len, 0, table, 0, window_tables=windows) for _ in range(num_seqs)]
        return StepInput.build(seqs, self.block_size, aux_layer_ids, layout.chunk_size if layout else None)

    def _forward(self, input_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping,
                 window_starts, window_tables, window_slot_mapping, query_len: int, aux_layer_ids: tuple[int, ...]):
        num_tokens = input_ids.shape[0]
        step = StepInput(input_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping,
                         logits_indices=torch.arange(num_tokens), max_query_len=query_len,
                         max_seq_len=block_tables.shape[1] * self.block_size, aux_layer_ids=list(aux_layer_ids),
                         window_starts=window_starts, window_tables=window_tables,
                         window_slot_mapping=window_slot_mapping)
        attn_meta = PagedAttentionMetadata(query_start_loc, seq_lens, block_tables, self.block_size, query_len,
                                           step.max_seq_len, num_tokens=num_tokens, is_uniform=True)
        hidden, aux = self.model(input_ids, positions, step, aux_layer_ids, attn_meta=attn_meta)
        return self.model.compute_logits(hidden), aux
