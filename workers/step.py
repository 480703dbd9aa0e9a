"""One model step as the runner consumes it (StepPlan, StepInput), and what it returns (StepOutput).

Every step is a flat, ragged batch of sequences: a prefill chunk, a decode (one token), or a
speculative verification (k+1 tokens) all look alike: `query_len` new tokens appended to a
sequence that already has `seq_len - query_len` tokens in the KV cache.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field, fields

import torch

from warpspec.workers import wire

# array typecodes of the integer dtypes steps carry
_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) for int64 or int32, at a third of the cost (0.8 against
    2.7 us): through an array's buffer, which the tensor keeps. A step builds ~20 small tensors."""
    if not values:  # frombuffer takes no empty buffer
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


@dataclass
class SequenceStep:
    """One sequence's share of a step, as the engine plans it."""

    token_ids: list[int]  # the new tokens to run
    num_cached: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # KV blocks covering at least num_cached + len(token_ids) tokens
    logits_from: int  # return logits for new tokens [logits_from, len(token_ids))
    request_id: str = ""  # names the sequence across steps (persistent_batch.py)
    # A hybrid KV cache's chunked groups' tables (kv_groups.py), position-indexed like block_table;
    # entries before the current chunk's block are stale (freed) and never read.
    window_tables: list[list[int]] = field(default_factory=list)


@dataclass
class StepPlan:
    """One step as the engine hands it to an executor: the scheduled sequences, in order, and the
    requests that left since the previous step (ranks keeping a persistent batch forget them)."""

    seqs: list[SequenceStep]
    block_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    left_request_ids: list[str] = field(default_factory=list)
    chunk_size: int | None = None  # the chunked KV groups' chunk, when the cache is hybrid

    def build(self) -> StepInput:
        return StepInput.build(self.seqs, self.block_size, self.aux_layer_ids, self.chunk_size)


def padded_block_tables(tables: list[list[int]], num_blocks: int) -> torch.Tensor:
    """[len(tables), num_blocks] int32: each table's first num_blocks blocks, padded with 0."""
    # One tensor from padded lists: a tensor per row costs a few microseconds each, every step. The
    # lists are joined in C (+=), not by a comprehension over every block: 12.3 against 15.3 us for 40
    # rows of up to 6 blocks (a hybrid cache's 5 window groups at batch 8), 24 against 32 for 64 of 12.
    flat: list[int] = []
    for table in tables:
        row = table[:num_blocks]
        flat += row
        if len(row) < num_blocks:
            flat += [0] * (num_blocks - len(row))
    return int_tensor(flat, torch.int32).view(len(tables), num_blocks)


def window_inputs(seqs: list[SequenceStep], block_size: int, chunk_size: int) -> dict[str, torch.Tensor]:
    """StepInput's window fields: each chunked group's table from the block holding the chunk start
    of the sequence's first new position, and the slots of its new tokens in each group.

    Chunk 32, block 16, 40 cached + 4 new: the chunk starts at 32, so each window table is the
    group's blocks 2 and 3 (positions 32..63), window_starts 32."""
    starts, rows, slots = [], [], []
    for seq in seqs:
        first = seq.num_cached // chunk_size * chunk_size // block_size
        end = -(-(seq.num_cached + len(seq.token_ids)) // block_size)
        starts.append(first * block_size)
        rows.append([table[first:end] for table in seq.window_tables])
        for p in range(seq.num_cached, seq.num_cached + len(seq.token_ids)):
            slots.extend(table[p // block_size] * block_size + p % block_size for table in seq.window_tables)
    num_groups, width = len(rows[0]), max(len(row[0]) for row in rows)
    tables = padded_block_tables([table for row in rows for table in row], width)
    return {"window_starts": int_tensor(starts), "window_tables": tables.view(len(seqs), num_groups, width),
            "window_slot_mapping": int_tensor(slots).view(-1, num_groups)}


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [num_seqs] int64, tokens in cache after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the flat batch to score
    max_query_len: int
    max_seq_len: int
    # Target layers whose entering hidden states the step must return (EAGLE-3's features).
    aux_layer_ids: list[int] = field(default_factory=list)
    # A hybrid KV cache's chunked groups (kv_groups.py), None otherwise: each sequence's tables from
    # the block holding its first new token's chunk start, which is position window_starts[s].
    window_starts: torch.Tensor | None = None  # [num_seqs] int64, multiples of the block size
    window_tables: torch.Tensor | None = None  # [num_seqs, num_window_groups, max_window_blocks] int32
    window_slot_mapping: torch.Tensor | None = None  # [num_tokens, num_window_groups] int64

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(cls, seqs: list[SequenceStep], block_size: int, aux_layer_ids: list[int] | None = None,
              chunk_size: int | None = None) -> StepInput:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for seq in seqs:
            start = len(input_ids)
            new_positions = range(seq.num_cached, seq.num_cached + len(seq.token_ids))
            input_ids.extend(seq.token_ids)
            positions.extend(new_positions)
            slot_mapping.extend(seq.block_table[p // block_size] * block_size + p % block_size
                                for p in new_positions)
            logits_indices.extend(range(start + seq.logits_from, start + len(seq.token_ids)))
            query_start_loc.append(len(input_ids))
            seq_lens.append(seq.num_cached + len(seq.token_ids))
        max_seq_len = max(seq_lens)
        block_tables = padded_block_tables([seq.block_table for seq in seqs], -(-max_seq_len // block_size))
        windows = window_inputs(seqs, block_size, chunk_size) if chunk_size and seqs[0].window_tables else {}
        return cls(
            input_ids=int_tensor(input_ids),
            positions=int_tensor(positions),
            query_start_loc=int_tensor(query_start_loc),
            seq_lens=int_tensor(seq_lens),
            block_tables=block_tables,
            slot_mapping=int_tensor(slot_mapping),
            logits_indices=int_tensor(logits_indices),
            max_query_len=max(len(s.token_ids) for s in seqs),
            max_seq_len=max_seq_len,
            aux_layer_ids=list(aux_layer_ids or []),
            **windows,
        )

    def to(self, device: torch.device | str) -> StepInput:
        if self.input_ids.device == torch.device(device):  # every field lives on one device
            return self
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return StepInput(**fields)

    def to_bytes(self) -> bytes:
        return wire.encode({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_bytes(cls, data: bytes) -> StepInput:
        return cls(**wire.decode(data))


@dataclass
class StepOutput:
    logits: torch.Tensor | None  # [num_logits, vocab] float32, rows of step.logits_indices; None off rank 0
    aux_hidden: list[torch.Tensor] = field(default_factory=list)  # each [num_tokens, hidden]
    compute_s: float = 0.0  # the rank's own time in execute, to separate compute from dispatch

    def to_bytes(self) -> bytes:
        return wire.encode({"logits": self.logits, "aux_hidden": self.aux_hidden, "compute_s": self.compute_s})

    @classmethod
    def from_bytes(cls, data: bytes) -> StepOutput:
        decoded = wire.decode(data)
        return cls(decoded["logits"], decoded["aux_hidden"] or [], decoded["compute_s"])
