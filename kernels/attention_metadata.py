"""What a paged-attention kernel reads about a step's batch besides the tensors themselves: built once a
step, reused by every layer, and shared by the torch reference (attention.py) and the Triton kernel
(triton/attention.py)."""

from __future__ import annotations

import functools

import torch


class PagedAttentionMetadata:
    def __init__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int, max_query_len: int, max_seq_len: int, num_tokens: int | None = None,
                 is_uniform: bool = False, kv_starts: torch.Tensor | None = None):
        """query_start_loc [num_seqs + 1]; seq_lens [num_seqs] (tokens in cache, this step's
        included); block_tables [num_seqs, >= ceil(max_seq_len / block_size)]. kv_starts [num_seqs]:
        the position each table's first block starts at, a multiple of block_size (None: 0). A
        chunked layer's table of a hybrid KV cache holds only the blocks from its chunk's start
        (workers/kv_groups.py): then max_seq_len is the longest span a table covers, not the longest
        sequence, and attention reads no further back. num_tokens: the step's
        token count when the caller knows it (reading query_start_loc[-1] would wait for the GPU,
        which a CUDA graph capture forbids). is_uniform: every sequence has max_query_len new tokens,
        so the queries reshape into [num_seqs, max_query_len] with no gather or boolean mask (whose
        data-dependent shape a compiled step cannot keep in one graph)."""
        self.query_start_loc = query_start_loc
        self.query_lens = query_start_loc[1:] - query_start_loc[:-1]
        self.num_tokens = int(query_start_loc[-1]) if num_tokens is None else num_tokens
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.block_size = block_size
        self.max_query_len = max_query_len
        self.max_seq_len = max_seq_len
        self.is_uniform = is_uniform or max_query_len == 1  # one query per sequence is uniform too
        self.kv_starts = kv_starts
        self._padded: dict[str, torch.Tensor] | None = None
        self._like: PagedAttentionMetadata | None = None  # over_tables: the same positions, other blocks
        self.masks: dict[int | None, torch.Tensor] = {}

    def over_tables(self, block_tables: torch.Tensor, max_seq_len: int, kv_starts: torch.Tensor | None,
                    like: PagedAttentionMetadata | None = None) -> PagedAttentionMetadata:
        """The same queries over other block tables (a hybrid KV cache's chunked group's: its window
        tables from kv_starts). like: metadata of another group over the same positions, whose masks
        this one shares (they depend on positions, not on block ids)."""
        other = PagedAttentionMetadata(self.query_start_loc, self.seq_lens, block_tables, self.block_size,
                                       self.max_query_len, max_seq_len, self.num_tokens, self.is_uniform, kv_starts)
        if like is not None:
            other.masks, other._like = like.masks, like
        return other

    # What the Triton kernel needs instead of the padded views, built on first use (the reference
    # never needs them): each token's sequence and position.
    # query_lens [2, 1], seq_lens [7, 4] -> token_seq [0, 0, 1], token_pos [5, 6, 3].
    @functools.cached_property
    def token_seq(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.seq_lens), device=self.seq_lens.device),
                                       self.query_lens, output_size=self.num_tokens)

    @functools.cached_property
    def token_pos(self) -> torch.Tensor:
        token_offset = (torch.arange(self.num_tokens, device=self.seq_lens.device)
                        - self.query_start_loc[:-1][self.token_seq])
        return (self.seq_lens - self.query_lens)[self.token_seq] + token_offset

    @functools.cached_property
    def table_starts(self) -> torch.Tensor:
        """kv_starts, zeros when every table starts at position 0 (the Triton kernel reads one)."""
        return self.kv_starts if self.kv_starts is not None else torch.zeros_like(self.seq_lens)

    def padded(self) -> dict[str, torch.Tensor]:
        """The reference's padded views, built on first use (the Triton kernel never needs them)."""
        if self._padded is None and self._like is not None:  # only the slots differ
            self._padded = {**self._like.padded(), "slots": self._slots(self._like.padded()["kv_positions"])}
        if self._padded is None:
            device = self.seq_lens.device
            # Pad the ragged queries into [num_seqs, max_query_len]: seq 0 with 2 queries, seq 1 with
            # 1 -> rows [[t0, t1], [t2, pad]].
            q_offsets = torch.arange(self.max_query_len, device=device)
            kv_positions = torch.arange(self.max_seq_len, device=device)
            self._padded = {
                "is_real_query": q_offsets[None, :] < self.query_lens[:, None],
                "token_index": (self.query_start_loc[:-1, None] + q_offsets[None, :]).clamp(
                    max=max(self.num_tokens - 1, 0)),
                "q_positions": (self.seq_lens - self.query_lens)[:, None] + q_offsets[None, :],
                "kv_positions": kv_positions,
                "slots": self._slots(kv_positions),
            }
            # [num_seqs or 1, max_seq_len]: the position each slot holds. Table from 32, block 16:
            # slots hold 32, 33, ... (a chunk starting at 40 masks 32..39 of its first block).
            self._padded["kv_abs_positions"] = (kv_positions[None, :] if self.kv_starts is None
                                                else self.kv_starts[:, None] + kv_positions[None, :])
        return self._padded

    def _slots(self, kv_positions: torch.Tensor) -> torch.Tensor:
        """Each sequence's cache slots in position order from its table's start, through the table."""
        return (self.block_tables.long()[:, kv_positions // self.block_size] * self.block_size
                + kv_positions % self.block_size)

    def mask(self, chunk_size: int | None) -> torch.Tensor:
        """[num_seqs, 1, max_query_len, max_seq_len] bool: causal, and for chunked layers within the
        query's chunk (positions 0..c-1 form chunk 0, c..2c-1 chunk 1, ...)."""
        if chunk_size not in self.masks:
            padded = self.padded()
            kv, q = padded["kv_abs_positions"][:, None, :], padded["q_positions"][:, :, None]
            allowed = kv <= q
            if chunk_size is not None:
                # The query's chunk, as kv // c == q // c: with kv <= q, kv at or past the chunk's
                # first position. A comparison per key, where the division was one per key that a
                # compiled step could not vectorize once the keys start mid-context (a hybrid cache's
                # window tables): 64-bit lanes have no SIMD division.
                allowed &= kv >= q - q % chunk_size
            # Padding queries attend to position 0 so their softmax stays finite; they are dropped.
            allowed |= ~padded["is_real_query"][:, :, None] & (padded["kv_positions"] == 0)[None, None, :]
            self.masks[chunk_size] = allowed[:, None, :, :]
        return self.masks[chunk_size]
