"""CUDA graphs for decode and verification steps: the launch-overlap half of the GPU record.

A decode step of a large MoE runs hundreds of small kernels; launched one by one from Python, the
gaps between them cost as much as the kernels at small batch. Replaying a captured graph launches
them all at once. A graph fixes every shape, so a step is run through one only when it is uniform:
every sequence has the same number of new tokens (1 for decode, k+1 for verification) and logits
are wanted for all of them. The batch is padded up to the next captured size with padding
sequences whose tokens write into a spare KV block that no sequence owns; their outputs are
dropped. Steps outside the captured sizes (prefill chunks, mixed steps, large batches) run eagerly.
A hybrid KV cache's steps (workers/kv_groups.py) also carry each chunked group's window table; a
graph holds them at the widest a window can be (its chunk and the step's tokens, from a chunk start
inside a block), so one graph serves every context length up to max_model_len.

Graphs are captured lazily, the first time a (batch size, query length, captured layers) shape is
seen, and all share one memory pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from warpspec.workers.step import StepInput

T = TypeVar("T")


@dataclass(frozen=True)
class CudaGraphConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    query_lens: tuple[int, ...] = (1, 4)  # decode; verification with k = 3
    max_model_len: int = 8192  # block tables of captured steps are this long; longer sequences run eagerly

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"cuda graph batch_sizes must be positive, got {self.batch_sizes}")
        if not self.query_lens or min(self.query_lens) < 1:
            raise ValueError(f"cuda graph query_lens must be positive, got {self.query_lens}")

    @property
    def several_sequences(self) -> bool:
        """Whether any graph runs several sequences: not when an engine admits one at a time."""
        return max(self.batch_sizes) > 1


def uniform_query_len(step: StepInput) -> int | None:
    """The common number of new tokens per sequence when the step is graph-shaped, else None."""
    # No sequence has more than max_query_len new tokens, so they all have that many exactly when
    # the total is num_seqs times it (integers only: tensor ops here cost ~30 us a step).
    q, num_tokens = step.max_query_len, step.num_tokens
    if num_tokens != step.seq_lens.shape[0] * q or step.logits_indices.shape[0] != num_tokens:
        return None
    return q


def max_window_blocks(chunk_size: int, query_len: int, block_size: int, max_blocks: int) -> int:
    """The widest window table a step of query_len tokens per sequence can carry, never wider than
    the whole table: from the block holding its chunk's start to its last new token. A chunk starts
    at most block_size - gcd(chunk_size, block_size) positions into its block, and a sequence's first
    new token at most chunk_size - 1 positions past the chunk start.

    Chunk 6, block 4, q 4: a chunk starts 0 or 2 positions into a block, so at most
    ceil((2 + 5 + 4) / 4) = 3 blocks (11 cached from the chunk start at 6: positions 4..14)."""
    widest_offset = block_size - math.gcd(chunk_size, block_size)
    return min(max_blocks, -(-(widest_offset + chunk_size - 1 + query_len) // block_size))


def pad_step(step: StepInput, batch_size: int, pad_block: int, max_blocks: int, block_size: int,
             window_blocks: int | None = None) -> StepInput:
    """The step padded to batch_size sequences of the same query length, block tables widened to
    max_blocks (a hybrid KV cache's window tables to window_blocks). Each padding sequence runs its
    q tokens (id 0) at positions 0..q-1 in pad_block, in every group.

    2 real sequences of 4 tokens padded to 4: query_start_loc [0, 4, 8] -> [0, 4, 8, 12, 16]."""
    num_seqs = step.seq_lens.shape[0]
    q = step.num_tokens // num_seqs
    num_pad = batch_size - num_seqs
    if num_pad < 0 or q > block_size or step.block_tables.shape[1] > max_blocks:
        raise ValueError(f"a step of {num_seqs} x {q} tokens does not fit a graph of {batch_size} sequences")
    pad_positions = torch.arange(q).repeat(num_pad)
    pad_slots = pad_block * block_size + pad_positions
    block_tables = torch.zeros(batch_size, max_blocks, dtype=torch.int32)
    block_tables[:num_seqs, : step.block_tables.shape[1]] = step.block_tables
    block_tables[num_seqs:, 0] = pad_block
    windows = {}
    if step.window_tables is not None:
        num_groups, width = step.window_tables.shape[1], step.window_tables.shape[2]
        if window_blocks is None or width > window_blocks:
            raise ValueError(f"a window of {width} blocks does not fit a graph's {window_blocks}")
        window_tables = torch.zeros(batch_size, num_groups, window_blocks, dtype=torch.int32)
        window_tables[:num_seqs, :, :width] = step.window_tables
        window_tables[num_seqs:, :, 0] = pad_block
        windows = {"window_starts": torch.cat([step.window_starts, torch.zeros(num_pad, dtype=torch.int64)]),
                   "window_tables": window_tables,
                   "window_slot_mapping": torch.cat([step.window_slot_mapping,
                                                     pad_slots[:, None].expand(-1, num_groups)])}
    return StepInput(
        input_ids=torch.cat([step.input_ids, torch.zeros(num_pad * q, dtype=torch.int64)]),
        positions=torch.cat([step.positions, pad_positions]),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int64) * q,
        seq_lens=torch.cat([step.seq_lens, torch.full((num_pad,), q, dtype=torch.int64)]),
        block_tables=block_tables,
        slot_mapping=torch.cat([step.slot_mapping, pad_slots]),
        logits_indices=torch.arange(batch_size * q, dtype=torch.int64),
        max_query_len=q,
        max_seq_len=max_blocks * block_size,
        aux_layer_ids=list(step.aux_layer_ids),
        **windows,
    )


def capture(run: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """run() captured as a CUDA graph in pool, and the outputs its replays write. run reads only
    tensors that stay in place (the caller copies each replay's inputs into them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: Triton compiles and autotunes outside the capture
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph, outputs


# The tensors a captured step reads, copied into its buffers before each replay (window ones: None
# unless the KV cache is hybrid).
STEP_TENSORS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping",
                "window_starts", "window_tables", "window_slot_mapping")


class CapturedStep:
    """One graph with the input tensors it reads and the outputs it writes."""

    def __init__(self, model, inputs: StepInput, pool):
        self.inputs = inputs
        self.graph, (self.logits, self.aux) = capture(lambda: self._forward(model), pool)

    def _forward(self, model):
        hidden, aux = model(self.inputs.input_ids, self.inputs.positions, self.inputs,
                            tuple(self.inputs.aux_layer_ids))
        return model.compute_logits(hidden), aux

    def replay(self, step: StepInput) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        for name in STEP_TENSORS:
            buffer = getattr(self.inputs, name)
            if buffer is not None:
                buffer.copy_(getattr(step, name), non_blocking=True)
        self.graph.replay()
        return self.logits, self.aux


class CudaGraphRunner:
    """Runs graph-shaped steps through captured graphs; `run` returns None for any other step."""

    def __init__(self, model, config: CudaGraphConfig, pad_block: int, max_blocks: int, block_size: int,
                 device: torch.device, chunk_size: int | None = None):
        """chunk_size: the chunked KV groups' chunk when the KV cache is hybrid (kv_groups.py)."""
        self.model = model
        self.config = config
        self.pad_block = pad_block
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = device
        self.chunk_size = chunk_size
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, tuple[int, ...]], CapturedStep] = {}
        self.num_replays = 0

    def graph_batch_size(self, step: StepInput) -> int | None:
        q = uniform_query_len(step)
        if q is None or q not in self.config.query_lens or q > self.block_size:
            return None
        if step.block_tables.shape[1] > self.max_blocks:
            return None
        fitting = [b for b in self.config.batch_sizes if b >= step.seq_lens.shape[0]]
        return min(fitting) if fitting else None

    def run(self, step: StepInput) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """step on the host; the real sequences' (logits, aux hidden), or None to run eagerly."""
        batch_size = self.graph_batch_size(step)
        if batch_size is None:
            return None
        num_tokens = step.num_tokens
        window_blocks = (None if self.chunk_size is None
                         else max_window_blocks(self.chunk_size, step.max_query_len, self.block_size, self.max_blocks))
        padded = pad_step(step, batch_size, self.pad_block, self.max_blocks, self.block_size, window_blocks)
        key = (batch_size, padded.max_query_len, tuple(step.aux_layer_ids))
        if key not in self.graphs:
            self.graphs[key] = CapturedStep(self.model, padded.to(self.device), self.pool)
        logits, aux = self.graphs[key].replay(padded.to(self.device))
        self.num_replays += 1
        # Clone: the next replay overwrites the graph's output buffers.
        return (logits[:num_tokens].clone() if logits is not None else None), [a[:num_tokens].clone() for a in aux]
