"""A step's attention metadata as a chunked layer of a hybrid KV cache sees it (kernel tests)."""

from __future__ import annotations

import torch

from warpspec.kernels.attention_metadata import PagedAttentionMetadata


def window_of(meta: PagedAttentionMetadata, chunk_size: int, scramble: bool = True) -> PagedAttentionMetadata:
    """meta's batch as a chunked layer of a hybrid KV cache sees it: each table from the block that
    holds the chunk start of the sequence's first query on. scramble: the blocks before it are
    overwritten in the table (freed and taken by others), so reading them would show."""
    block_size, tables = meta.block_size, meta.block_tables.clone()
    first_query = (meta.seq_lens - meta.query_lens).tolist()
    first_blocks = [(p // chunk_size) * chunk_size // block_size for p in first_query]
    spans = [-(-n // block_size) - first for n, first in zip(meta.seq_lens.tolist(), first_blocks, strict=True)]
    windows = torch.zeros(len(spans), max(spans), dtype=torch.int32)
    for row, (first, span) in enumerate(zip(first_blocks, spans, strict=True)):
        windows[row, :span] = tables[row, first : first + span]
        if scramble:
            tables[row, :first] = 0
    return PagedAttentionMetadata(meta.query_start_loc, meta.seq_lens, windows, block_size, meta.max_query_len,
                                  max(spans) * block_size, is_uniform=meta.is_uniform,
                                  kv_starts=torch.tensor(first_blocks) * block_size)

