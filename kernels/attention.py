"""Attention over the paged KV cache, torch reference.

One op serves prefill (many queries per sequence), decode (one) and speculative verification (k+1):
each sequence's queries are the LAST `query_len` positions of its `seq_len` tokens. RoPE layers of
Llama 4 attend within their `chunk_size` chunk only; NoPE layers pass chunk_size=None (full causal).
"""

import torch
import torch.nn.functional as F


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    chunk_size: int | None,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim]; key/value_cache [num_blocks, block_size, num_kv_heads,
    head_dim]; query_start_loc [num_seqs + 1]; seq_lens [num_seqs] (tokens in cache, this step's
    included); block_tables [num_seqs, >= ceil(max_seq_len / block_size)].
    Returns [num_tokens, num_heads, head_dim]."""
    num_tokens, _, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    device = query.device
    query_lens = query_start_loc[1:] - query_start_loc[:-1]

    # Pad the ragged queries into [num_seqs, max_query_len]: seq 0 with 2 queries, seq 1 with 1 ->
    # rows [[t0, t1], [t2, pad]].
    q_offsets = torch.arange(max_query_len, device=device)
    is_real_query = q_offsets[None, :] < query_lens[:, None]
    token_index = (query_start_loc[:-1, None] + q_offsets[None, :]).clamp(max=num_tokens - 1)
    q = query[token_index]
    q_positions = (seq_lens - query_lens)[:, None] + q_offsets[None, :]

    # Gather each sequence's cached keys/values in position order through its block table.
    kv_positions = torch.arange(max_seq_len, device=device)
    slots = block_tables.long()[:, kv_positions // block_size] * block_size + kv_positions % block_size
    k = key_cache.view(-1, num_kv_heads, head_dim)[slots]
    v = value_cache.view(-1, num_kv_heads, head_dim)[slots]

    # mask [num_seqs, max_query_len, max_seq_len]: causal, within the sequence's length, and for
    # chunked layers within the query's chunk (positions 0..c-1 form chunk 0, c..2c-1 chunk 1, ...).
    allowed = kv_positions[None, None, :] <= q_positions[:, :, None]
    if chunk_size is not None:
        allowed &= (kv_positions[None, None, :] // chunk_size) == (q_positions[:, :, None] // chunk_size)
    # Padding queries attend to position 0 so their softmax stays finite; they are dropped below.
    allowed |= ~is_real_query[:, :, None] & (kv_positions == 0)[None, None, :]

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=allowed[:, None, :, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[is_real_query]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's key/value [num_tokens, num_kv_heads, head_dim] at their cache slots
    (slot = block_id * block_size + offset)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = key
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = value
