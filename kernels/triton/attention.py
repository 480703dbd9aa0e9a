"""Paged attention for any number of queries per sequence (decode: 1, verify: k+1, prefill: many).

One program per (query token, KV head, context split): it loads the query rows of every query head
that shares the KV head (GQA: Maverick's 5 query heads per KV head on each of 8 ranks), then walks
its share of the visible positions [start, pos] in tiles of TILE tokens with an online softmax, so K
and V are read once per group. start = 0 for NoPE layers (full causal) and the first position of
the query's chunk for chunked-local RoPE layers. Each token of a tile finds its cache slot through
the block table, so a tile may span several KV blocks (tl.dot wants at least 16 rows on a GPU,
whatever the block size). A table may start past position 0 (a chunked layer's of a hybrid KV cache
holds blocks from its chunk's start only): its first block holds position table_start.

Decode at small batch has few (token, KV head) pairs, one KV head per rank on Maverick: a single
program would walk the whole context alone. The context is then split over several programs (as in
flash-decoding), each writing its partial softmax state (max, sum, weighted values), and a second
kernel merges them: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s.
Deterministic mode (kernels/batch_invariant.py) never splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpspec.kernels import batch_invariant
from warpspec.kernels.attention_metadata import PagedAttentionMetadata

TILE = 32  # tokens per step of the walk
SPLIT_TOKENS = 512  # a context is split only into pieces at least this long
MAX_SPLITS = 16


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, max_ptr, sum_ptr, acc_ptr, block_tables_ptr,
                            table_starts_ptr, token_seq_ptr, token_pos_ptr, scale, chunk_size, heads_per_kv,
                            num_heads, num_kv_heads, block_table_stride, num_splits, BLOCK_SIZE: tl.constexpr,
                            HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                            DOT_FP32: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    pos = tl.load(token_pos_ptr + token).to(tl.int32)
    dims = tl.arange(0, HEAD_DIM)
    group = tl.arange(0, GROUP)
    is_head = group < heads_per_kv
    heads = kv_head * heads_per_kv + group
    q = tl.load(q_ptr + (token * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
                mask=is_head[:, None], other=0.0)  # [GROUP, HEAD_DIM]
    start = (pos // chunk_size) * chunk_size  # chunk_size 2^30 for full causal: start 0
    table_start = tl.load(table_starts_ptr + seq).to(tl.int32)  # the position of the table's first block
    # This split's tiles among those covering [start, pos].
    first_tile = start // TILE
    num_tiles = pos // TILE - first_tile + 1
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)
    row_max = tl.full((GROUP,), float("-inf"), tl.float32)
    row_sum = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, HEAD_DIM), tl.float32)
    offsets = tl.arange(0, TILE)
    for tile in range(tile_begin, tile_end):
        positions = tile * TILE + offsets
        is_visible = (positions >= start) & (positions <= pos)
        blocks = tl.load(block_tables_ptr + seq * block_table_stride + (positions - table_start) // BLOCK_SIZE,
                         mask=is_visible,
                         other=0).to(tl.int64)
        slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        kv_offsets = (slots[:, None] * num_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=is_visible[:, None], other=0.0)  # [TILE, HEAD_DIM]
        v = tl.load(v_cache_ptr + kv_offsets, mask=is_visible[:, None], other=0.0)
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(is_visible[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        if DOT_FP32:
            acc = acc * rescale[:, None] + tl.dot(probs, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        row_max = new_max
    # Partial state per (token, head, split); a split with no tiles leaves max -inf and sums 0.
    state = (token * num_heads + heads) * num_splits + split
    tl.store(max_ptr + state, row_max, mask=is_head)
    tl.store(sum_ptr + state, row_sum, mask=is_head)
    tl.store(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], acc, mask=is_head[:, None])


@triton.jit
def _merge_splits_kernel(max_ptr, sum_ptr, acc_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr,
                         SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # token * num_heads + head
    splits = tl.arange(0, SPLITS)
    is_split = splits < num_splits
    split_max = tl.load(max_ptr + row * num_splits + splits, mask=is_split, other=float("-inf"))
    overall = tl.max(split_max, axis=0)
    weights = tl.where(is_split, tl.exp(split_max - overall), 0.0)
    total = tl.sum(tl.load(sum_ptr + row * num_splits + splits, mask=is_split, other=0.0) * weights, axis=0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
                  mask=is_split[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / total
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_tokens: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Enough programs to fill a GPU's ~132 SMs when few (token, KV head) pairs exist, never pieces
    shorter than SPLIT_TOKENS. Depends on shapes only (CUDA graphs see one fixed value)."""
    pairs = num_tokens * num_kv_heads
    if pairs >= 128:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(128, pairs), triton.cdiv(max_seq_len, SPLIT_TOKENS)))


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float, chunk_size: int | None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Same contract as kernels.attention.paged_attention; num_splits overrides choose_num_splits."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"the Triton paged attention needs power-of-two head_dim and block_size, got "
                         f"{head_dim} and {block_size}")
    heads_per_kv = num_heads // num_kv_heads
    query = query.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    # Deterministic mode walks each query's whole context in one program: a split chosen by the batch's
    # shape would sum a query's context in a batch-dependent order.
    splits = num_splits or (1 if batch_invariant.is_enabled()
                            else choose_num_splits(num_tokens, num_kv_heads, meta.max_seq_len))
    states = num_tokens * num_heads * splits
    split_max = torch.empty(states, dtype=torch.float32, device=query.device)
    split_sum = torch.empty(states, dtype=torch.float32, device=query.device)
    split_acc = torch.empty(states, head_dim, dtype=torch.float32, device=query.device)
    # tl.dot wants at least 16 rows on a GPU; the padding rows are masked out.
    group = max(16, triton.next_power_of_2(heads_per_kv))
    _paged_attention_kernel[(num_tokens, num_kv_heads, splits)](
        query, key_cache, value_cache, split_max, split_sum, split_acc, meta.block_tables, meta.table_starts,
        meta.token_seq,
        meta.token_pos, scale, chunk_size or 1 << 30, heads_per_kv, num_heads, num_kv_heads,
        meta.block_tables.stride(0), splits, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, TILE=TILE,
        DOT_FP32=query.dtype == torch.float32 or not query.is_cuda)
    _merge_splits_kernel[(num_tokens * num_heads,)](split_max, split_sum, split_acc, out, splits,
                                                    HEAD_DIM=head_dim, SPLITS=triton.next_power_of_2(splits))
    return out
