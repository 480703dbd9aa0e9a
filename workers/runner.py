"""One rank's model runner: owns the model and its KV cache, and runs steps."""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import torch
from tqdm import tqdm

from warpspec.kernels import batch_invariant
from warpspec.kernels.dispatch import kernel_mode, triton_available
from warpspec.workers.compile.compile_helpers import build_in_helpers
from warpspec.workers.compile.compiled_step import CompiledStepRunner
from warpspec.workers.compile.cpu_threads import advise_on_sleeping_threads, fastest_thread_count, graph_thread_count
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig, CudaGraphRunner
from warpspec.workers.distributed.comm import Communicator, collective_failures
from warpspec.workers.kv_cache import CacheConfig, allocate_kv_cache
from warpspec.workers.kv_groups import kv_group_layout
from warpspec.workers.loader import load_model
from warpspec.workers.step import StepInput, StepOutput


class ModelRunner:
    def __init__(self, model_dir: str | Path, dtype: str | torch.dtype = "auto",
                 cache_config: CacheConfig | None = None, device: str | torch.device = "cpu",
                 comm: Communicator | None = None, cuda_graphs: CudaGraphConfig | None = None,
                 quantization: str | None = None, moe_parallel: str = "tensor", deterministic: bool = False):
        """cuda_graphs: the decode/verify step shapes to capture as CUDA graphs on CUDA devices (not
        when the torch references run there: WARPSPEC_KERNELS=reference or no Triton), or to run
        torch.compile'd on the CPU (workers/compile/compiled_step.py); None runs every step eagerly.
        deterministic: run (and capture) every step in kernels/batch_invariant.py's mode."""
        self.device = torch.device(device)
        self.deterministic = deterministic
        self.cache_config = cache_config or CacheConfig()
        self.model = load_model(model_dir, dtype, self.device, comm, quantization, moe_parallel)
        self.config = self.model.config
        self.dtype = self.model.embedding_table().dtype
        # Every rank holds the same number of KV heads (replicated when there are more ranks than
        # heads), so every rank computes the same block count from the same per-rank budget.
        self.num_kv_heads = self.model.num_kv_heads
        self.num_blocks = self.cache_config.resolve_num_blocks(self.config, self.num_kv_heads, self.dtype)
        self.kv_layout = kv_group_layout(self.config, self.cache_config.hybrid)
        # The references read values back to the host (a capture forbids it): graphs need Triton.
        use_graphs = (cuda_graphs is not None and self.device.type == "cuda" and kernel_mode() != "reference"
                      and triton_available())
        # On the CPU the same steps run compiled instead. Deterministic mode stays eager: its float64
        # weight copies are made on first use, a side effect a compiled graph would not keep.
        # Over several CPU ranks the collectives are traced ones (Communicator._traced_all_reduce): as
        # torch.distributed calls they split the graph twice per layer (measured on the bundled pair over
        # 2 workers: 114 s to compile and 0.64x the eager speed).
        use_compiled = (cuda_graphs is not None and self.device.type == "cpu" and kernel_mode() == "auto"
                        and not deterministic
                        and (self.model.comm.world_size == 1 or self.model.comm.has_traced_collectives))
        # Graphs pad batches with sequences that write into one spare block past the engine's blocks.
        self.kv_caches = allocate_kv_cache(self.config, self.num_kv_heads, self.num_blocks + int(use_graphs),
                                           self.cache_config.block_size, self.dtype, self.device,
                                           self.kv_layout.num_tensors)
        self.model.bind_kv_cache(self.kv_caches, self.kv_layout)
        block_size = self.cache_config.block_size
        self.graph_runner = None
        if use_graphs:
            with batch_invariant.deterministic(deterministic):
                self.graph_runner = CudaGraphRunner(self.model, cuda_graphs, pad_block=self.num_blocks,
                                                    max_blocks=-(-cuda_graphs.max_model_len // block_size),
                                                    block_size=block_size, device=self.device,
                                                    chunk_size=self.kv_layout.chunk_size)
        elif use_compiled:
            self.graph_runner = CompiledStepRunner(self.model, cuda_graphs, block_size, self.kv_layout, self.kv_caches)
        # A compiled step's traced collectives fail as the step runs: a peer that died, as eagerly.
        self.compiled_ranks_meet = use_compiled and self.model.comm.world_size > 1

    def embedding_table(self) -> torch.Tensor | None:
        """The target's whole input embedding table [vocab, hidden], which a draft model may share;
        None over several ranks, each of which holds a vocabulary shard."""
        return self.model.embedding_table() if self.model.comm.world_size == 1 else None

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        """Build the compiled step graphs now, as CUDA-graph engines capture at start-up, so that no
        request waits for them (CompiledStepRunner.warm_up_steps), each with its thread count
        (cpu_threads.graph_thread_count); then steps check only the guards that tell the graphs
        apart (CountingCompiler.seal). Nothing to do otherwise. Over several ranks every rank warms
        up at once, on the same steps: they meet in each step's collectives. One rank alone first
        builds the graphs its compile cache lacks several at once, in helper processes
        (compile_helpers.py); every count is settled before, as a graph is saved under its count.
        On a CPU, first say whether OpenMP's threads sleep between regions
        (cpu_threads.sleeping_threads_advice)."""
        if self.device.type == "cpu":
            advise_on_sleeping_threads()
        if isinstance(self.graph_runner, CompiledStepRunner):
            runner = self.graph_runner
            steps = runner.warm_up_steps(aux_layer_ids)
            for step in steps:
                runner.set_threads(step, graph_thread_count(step.seq_lens.shape[0], runner.saved_thread_count(step),
                                                            lambda step=step: self._time_thread_counts(step)))
            if self.model.comm.world_size == 1:  # the longest builds first: several sequences, long queries
                by_length = sorted(steps, key=lambda step: (-step.seq_lens.shape[0], -step.max_query_len))
                build_in_helpers([functools.partial(self._build_graph, step) for step in by_length
                                  if not runner.is_saved(step)], "compiling the target's steps")
            for step in tqdm(steps, desc="compiling the target's steps", unit="graph", disable=None, leave=False):
                self.execute(step)
            runner.compiled.seal()

    @torch.inference_mode()
    def _build_graph(self, step: StepInput) -> None:
        self.graph_runner.build(step)

    @torch.inference_mode()
    def _time_thread_counts(self, step: StepInput) -> tuple[int, dict[int, float]]:
        return fastest_thread_count(lambda: self._eager_forward(step))

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        with batch_invariant.deterministic(self.deterministic):
            return self._execute(step)

    def _execute(self, step: StepInput) -> StepOutput:
        start = time.perf_counter()
        backend = type(self.model.comm).__name__
        with collective_failures(backend) if self.compiled_ranks_meet else contextlib.nullcontext():
            graphed = self.graph_runner.run(step) if self.graph_runner is not None else None
        if graphed is not None:
            logits, aux = graphed
        else:
            logits, aux = self._eager_forward(step)
        if logits is None:  # not rank 0: nothing large goes back
            aux = []
        return StepOutput(logits=logits, aux_hidden=aux, compute_s=time.perf_counter() - start)

    def _eager_forward(self, step: StepInput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        step = step.to(self.device)
        hidden, aux = self.model(step.input_ids, step.positions, step, tuple(step.aux_layer_ids))
        return self.model.compute_logits(hidden[step.logits_indices]), aux
