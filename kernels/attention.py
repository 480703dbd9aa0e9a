"""Attention over the paged KV cache: torch reference here, Triton version on CUDA tensors
(kernels/triton/attention.py).

One op serves prefill (many queries per sequence), decode (one) and speculative verification (k+1):
each sequence's queries are the LAST `query_len` positions of its `seq_len` tokens. RoPE layers of
Llama 4 attend within their `chunk_size` chunk only; NoPE layers pass chunk_size=None (full causal).

The index tensors and masks depend only on the step, not on the layer: `PagedAttentionMetadata`
builds them once per step and every layer reuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warpspec.kernels import batch_invariant
from warpspec.kernels.attention_metadata import PagedAttentionMetadata
from warpspec.kernels.dispatch import use_triton


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float, chunk_size: int | None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim]; key/value_cache [num_blocks, block_size, num_kv_heads,
    head_dim]. Returns [num_tokens, num_heads, head_dim]."""
    if use_triton(query):
        from warpspec.kernels.triton.attention import paged_attention_triton

        return paged_attention_triton(query, key_cache, value_cache, meta, scale, chunk_size)
    return paged_attention_reference(query, key_cache, value_cache, meta, scale, chunk_size)


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float, chunk_size: int | None) -> torch.Tensor:
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    padded = meta.padded()
    num_seqs = meta.seq_lens.shape[0]
    # [num_seqs, max_q, heads, dim]
    q = (query.view(num_seqs, meta.max_query_len, *query.shape[1:]) if meta.is_uniform
         else query[padded["token_index"]])
    k = key_cache.view(-1, num_kv_heads, head_dim)[padded["slots"]]
    v = value_cache.view(-1, num_kv_heads, head_dim)[padded["slots"]]
    if batch_invariant.is_enabled():
        # Padded to the batch's longest context: in float64 the masked positions' exact zeros and
        # the order of the sums leave each row's rounded output as it would be alone.
        q, k, v = q.double(), k.double(), v.double()
    if torch.compiler.is_compiling():
        out = _grouped_attention(q, k, v, meta.mask(chunk_size), scale).to(query.dtype)
    else:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=meta.mask(chunk_size), scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).to(query.dtype)
    return out.flatten(0, 1) if meta.is_uniform else out[padded["is_real_query"]]


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Softmax attention written out, for compiled steps: inductor fuses the mask, the softmax and
    the head grouping into its loops over a context length it keeps symbolic (its fused SDPA
    template is wrong for a symbolic context length in torch 2.13: NaN rows).

    q [num_seqs, max_q, heads, dim]; k, v [num_seqs, max_seq, kv_heads, dim]; mask [num_seqs, 1,
    max_q, max_seq]. Query head h reads KV head h // (heads / kv_heads), as enable_gqa does."""
    num_seqs, max_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    grouped = q.view(num_seqs, max_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bqkgd,bskd->bkgqs", grouped.float(), k.float()) * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # [num_seqs, kv_heads, group, max_q, max_seq]
    out = torch.einsum("bkgqs,bskd->bqkgd", scores.softmax(dim=-1), v.float())
    return out.reshape(num_seqs, max_q, num_heads, head_dim)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's key/value [num_tokens, num_kv_heads, head_dim] at their cache slots
    (slot = block_id * block_size + offset) of kv_cache [2, num_blocks, block_size, num_kv_heads,
    head_dim], keys then values.

    One indexed store into the whole cache tensor, not one into each half: a compiled step (see
    workers/compile/compiled_step.py) keeps a store into a graph input in place, but copies the whole cache
    for a store into a view of it."""
    block_size = kv_cache.shape[2]
    kv_half = torch.arange(2, device=kv_cache.device)[:, None]  # [2, 1] against [1, num_tokens]
    kv_cache.index_put_((kv_half, (slot_mapping // block_size)[None], (slot_mapping % block_size)[None]),
                        torch.stack([key, value]).to(kv_cache.dtype))
