"""Training-mode forward of warpspec's Llama 4 model: whole sequences, dense causal attention, no KV
cache. It runs the serving model's own modules (projections, RoPE/QK-norm/temperature tuning, fused
residual norms, sigmoid top-1 MoE), so what training optimises is exactly what serving computes, and
the trained module saves with the serving checkpoint writer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warpspec.workers.models.decoder import Attention, DecoderForCausalLM
from warpspec.workers.models.rotary import rope_freqs_cis


def attention_mask(length: int, chunk_size: int | None, device: torch.device) -> torch.Tensor | None:
    """[length, length] bool, causal and within the query's chunk; None when plain causal suffices."""
    if chunk_size is None or chunk_size >= length:
        return None
    pos = torch.arange(length, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] // chunk_size == pos[:, None] // chunk_size)


def dense_attention(attn: Attention, positions: torch.Tensor, hidden: torch.Tensor, freqs_cis: torch.Tensor,
                    batch: int, length: int) -> torch.Tensor:
    """hidden [batch * length, hidden] -> the attention block's output, same shape."""
    q, k, v = attn.project_qkv(positions, hidden, freqs_cis)
    q, k, v = (t.view(batch, length, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    mask = attention_mask(length, attn.chunk_size, hidden.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scale,
                                         enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(batch * length, -1))


def causal_lm_logits(model: DecoderForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [batch, length] -> logits [batch, length, vocab] (one rank, any dtype)."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).repeat(batch)
    freqs_cis = rope_freqs_cis(positions, model.inv_freq)
    hidden, residual = model.model.embed_tokens(input_ids.reshape(-1)), None
    for layer in model.model.layers:
        normed, residual = layer.input_layernorm(hidden, residual)
        hidden = dense_attention(layer.self_attn, positions, normed, freqs_cis, batch, length)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.feed_forward(hidden)
    hidden, _ = model.model.norm(hidden, residual)
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    return F.linear(hidden, head.weight).view(batch, length, -1)
