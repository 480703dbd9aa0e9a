"""Paged attention for any number of queries per sequence (decode: 1, verify: k+1, prefill: many).

One program per (query token, KV head): it loads the query rows of every query head that shares the
KV head (GQA: Maverick's 5 query heads per KV head on each of 8 ranks), then walks the token's cache
blocks through its block table with an online softmax, so K and V are read once per group. The
blocks walked are those holding positions [start, pos]: start = 0 for NoPE layers (full causal) and
the first position of the query's chunk for chunked-local RoPE layers; the last block is masked to
positions <= pos, the first to >= start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpspec.kernels.attention import PagedAttentionMetadata


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, token_seq_ptr,
                            token_pos_ptr, scale, chunk_size, heads_per_kv, num_heads, num_kv_heads,
                            block_table_stride, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                            GROUP: tl.constexpr, DOT_FP32: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    pos = tl.load(token_pos_ptr + token).to(tl.int32)
    dims = tl.arange(0, HEAD_DIM)
    group = tl.arange(0, GROUP)
    is_head = group < heads_per_kv
    heads = kv_head * heads_per_kv + group
    q = tl.load(q_ptr + (token * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
                mask=is_head[:, None], other=0.0)  # [GROUP, HEAD_DIM]
    start = (pos // chunk_size) * chunk_size  # chunk_size 2^30 for full causal: start 0
    row_max = tl.full((GROUP,), float("-inf"), tl.float32)
    row_sum = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, HEAD_DIM), tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for logical_block in range(start // BLOCK_SIZE, pos // BLOCK_SIZE + 1):
        block = tl.load(block_tables_ptr + seq * block_table_stride + logical_block).to(tl.int64)
        kv_offsets = ((block * BLOCK_SIZE + offsets[:, None]) * num_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets)  # [BLOCK_SIZE, HEAD_DIM]
        v = tl.load(v_cache_ptr + kv_offsets)
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        positions = logical_block * BLOCK_SIZE + offsets
        is_visible = (positions >= start) & (positions <= pos)
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
    out = acc / row_sum[:, None]
    tl.store(out_ptr + (token * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=is_head[:, None])


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float, chunk_size: int | None) -> torch.Tensor:
    """Same contract as kernels.attention.paged_attention."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"the Triton paged attention needs power-of-two head_dim and block_size, got "
                         f"{head_dim} and {block_size}")
    heads_per_kv = num_heads // num_kv_heads
    query = query.contiguous()
    out = torch.empty_like(query)
    if num_tokens:
        # tl.dot wants at least 16 rows on a GPU; the padding rows are masked out.
        group = max(16, triton.next_power_of_2(heads_per_kv))
        _paged_attention_kernel[(num_tokens, num_kv_heads)](
            query, key_cache, value_cache, out, meta.block_tables, meta.token_seq, meta.token_pos, scale,
            chunk_size or 1 << 30, heads_per_kv, num_heads, num_kv_heads, meta.block_tables.stride(0),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group,
            DOT_FP32=query.dtype == torch.float32 or not query.is_cuda)
    return out
