"""Compiled decode and verification steps on the CPU: the CPU's counterpart of CUDA graphs.

Eagerly, a decode step of a small model is mostly PyTorch dispatch: ~25 ops per layer at 10-20 us
each, for arithmetic that takes a fraction of that. `torch.compile` (inductor's C++ code) turns the
whole forward, logits included, into a few fused loops and GEMM calls. It does so only while every
step looks alike, so a step runs compiled only when it is uniform, as for the graphs: every
sequence has the same number of new tokens (1 for decode, k+1 for verification) and wants logits
for all of them. Prefill chunks, mixed steps and batches beyond the largest size run eagerly.

Shapes that would otherwise recompile the step:
- batch size and context length are symbolic (marked dynamic), so one graph serves every batch and
  context length of a query length;
- a one-sequence batch is padded with one sequence (torch specializes sizes of 1, and would compile
  batch 1 apart), whose tokens write into a spare KV block that no sequence owns, as for the graphs;
- block tables are widened to at least two blocks, for the same reason.

So a generation compiles once per (query length, captured layers): a 200-step generation at any
batch size compiles its decode step once (counted in `num_compiles`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from warpspec.kernels import PagedAttentionMetadata
from warpspec.workers.cuda_graphs import CudaGraphConfig, pad_step, uniform_query_len
from warpspec.workers.step import StepInput


def use_compile_cache(run_dir: str | Path) -> None:
    """Keep inductor's compiled code under run_dir, so a restart loads it instead of compiling again
    (unless the environment already names a cache)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(run_dir, "inductor").resolve()))


MIN_BATCH = 2  # see the module docstring: sizes of 1 are specialized
MIN_BLOCKS = 2


class CompiledStepRunner:
    """Runs uniform steps through torch.compile'd forwards; `run` returns None for any other step.

    config: the same shapes as the CUDA graphs (query lengths; batches up to the largest size)."""

    def __init__(self, model, config: CudaGraphConfig, pad_block: int, block_size: int):
        self.model = model
        self.config = config
        self.pad_block = pad_block
        self.block_size = block_size
        self.max_blocks = -(-config.max_model_len // block_size)
        self.num_compiles = 0  # graphs inductor built, for tests that hold a generation to one
        self._compiled = torch.compile(self._forward, backend=self._counting_inductor, dynamic=False)

    def _counting_inductor(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        return compile_fx(graph_module, example_inputs)

    def batch_size(self, step: StepInput) -> int | None:
        """The batch the step runs at once padded, or None to run it eagerly."""
        q = uniform_query_len(step)
        num_seqs = step.seq_lens.shape[0]
        if q is None or q not in self.config.query_lens or q > self.block_size:
            return None
        if num_seqs > max(self.config.batch_sizes) or step.block_tables.shape[1] > self.max_blocks:
            return None
        return max(num_seqs, MIN_BATCH)

    def run(self, step: StepInput) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """step on the host; the real sequences' (logits, aux hidden), or None to run eagerly."""
        batch_size = self.batch_size(step)
        if batch_size is None:
            return None
        num_tokens = step.num_tokens
        padded = pad_step(step, batch_size, self.pad_block, max(step.block_tables.shape[1], MIN_BLOCKS),
                          self.block_size)
        inputs = (padded.input_ids, padded.positions, padded.query_start_loc, padded.seq_lens,
                  padded.block_tables, padded.slot_mapping)
        for tensor in inputs:  # [num_tokens], [num_seqs + 1], [num_seqs, num_blocks]: all sizes vary
            for dim in range(tensor.dim()):
                torch._dynamo.mark_dynamic(tensor, dim)
        logits, aux = self._compiled(*inputs, padded.max_query_len, tuple(step.aux_layer_ids))
        return (logits[:num_tokens] if logits is not None else None), [a[:num_tokens] for a in aux]

    def _forward(self, input_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping,
                 query_len: int, aux_layer_ids: tuple[int, ...]):
        num_tokens = input_ids.shape[0]
        step = StepInput(input_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping,
                         logits_indices=torch.arange(num_tokens), max_query_len=query_len,
                         max_seq_len=block_tables.shape[1] * self.block_size, aux_layer_ids=list(aux_layer_ids))
        attn_meta = PagedAttentionMetadata(query_start_loc, seq_lens, block_tables, self.block_size, query_len,
                                           step.max_seq_len, num_tokens=num_tokens, is_uniform=True)
        hidden, aux = self.model(input_ids, positions, step, aux_layer_ids, attn_meta=attn_meta)
        return self.model.compute_logits(hidden), aux
