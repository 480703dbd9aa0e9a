"""Llama 4 text decoder (transformers' Llama4ForCausalLM), plain torch over a paged KV cache.

Knows nothing of serving: `forward(input_ids, positions, step)` runs one flat ragged batch and
returns the final hidden states; logits are computed separately for the rows that need them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warpspec.kernels import (
    apply_rope_interleaved,
    l2_norm,
    moe_experts,
    paged_attention,
    route_topk_sigmoid,
    write_kv_cache,
)
from warpspec.workers.layers import Embedding, Linear, RMSNorm, empty_param
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.rope import rope_freqs_cis, rope_inv_freq
from warpspec.workers.step import StepInput

# Checkpoint tensors that land in a slice of a stacked parameter: (our name, checkpoint name, shard).
# Matched on whole dotted segments, so "experts.gate_up_proj" is never mistaken for "up_proj".
STACKED_PARAMS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def map_checkpoint_name(name: str) -> tuple[str, object]:
    """Checkpoint tensor name (prefix already stripped) -> (our parameter name, shard id).

    "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "k")"""
    segments = name.split(".")
    for ours, theirs, shard_id in STACKED_PARAMS:
        if theirs in segments:
            segments[segments.index(theirs)] = ours
            return ".".join(segments), shard_id
    return name, None


class Llama4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.uses_rope = config.uses_rope(layer_id)
        self.uses_qk_norm = config.use_qk_norm and self.uses_rope
        self.uses_temperature_tuning = config.attn_temperature_tuning and not self.uses_rope
        self.chunk_size = config.chunk_size(layer_id)
        self.floor_scale = config.floor_scale
        self.attn_scale = config.attn_scale
        self.eps = config.rms_norm_eps
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, dtype,
                               shard_sizes={"q": q_size, "k": kv_size, "v": kv_size})
        self.o_proj = Linear(q_size, config.hidden_size, dtype)
        # [2, num_blocks, block_size, num_kv_heads, head_dim], bound by the runner.
        self.kv_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, step: StepInput,
                freqs_cis: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.uses_rope:
            q, k = apply_rope_interleaved(q, freqs_cis), apply_rope_interleaved(k, freqs_cis)
            if self.uses_qk_norm:
                q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        elif self.uses_temperature_tuning:
            # Longer contexts sharpen NoPE attention: q *= 1 + attn_scale * log1p(floor((p+1) / floor_scale)).
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        key_cache, value_cache = self.kv_cache[0], self.kv_cache[1]
        write_kv_cache(k, v, key_cache, value_cache, step.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, step.query_start_loc, step.seq_lens,
                              step.block_tables, self.scale, self.chunk_size,
                              step.max_query_len, step.max_seq_len)
        return self.o_proj(out.reshape(num_tokens, q_size))


class Llama4MLP(nn.Module):
    """SwiGLU MLP: the dense layers' feed-forward and the MoE's always-on shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype,
                                   shard_sizes={0: intermediate_size, 1: intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Llama4Experts(nn.Module):
    """Routed experts in the checkpoint's fused layout: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        num_experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = empty_param(num_experts, hidden, 2 * inter, dtype=dtype)
        self.down_proj = empty_param(num_experts, inter, hidden, dtype=dtype)


class Llama4MoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Linear(config.hidden_size, config.num_local_experts, dtype)
        self.experts = Llama4Experts(config, dtype)
        self.shared_expert = Llama4MLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, scores = route_topk_sigmoid(self.router(x), self.top_k)
        routed = moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, expert_ids, scores)
        return self.shared_expert(x) + routed


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Llama4Attention(config, layer_id, dtype)
        if config.is_moe_layer(layer_id):
            self.feed_forward: nn.Module = Llama4MoE(config, dtype)
        else:
            self.feed_forward = Llama4MLP(config.hidden_size, config.intermediate_size_mlp, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                step: StepInput, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden is the previous layer's un-added MLP output (the embedding for layer 0); returns
        this layer's un-added MLP output and the residual stream, for the next fused add+norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, step, freqs_cis)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class Llama4Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(Llama4DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Llama4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.model = Llama4Model(config, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepInput,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions [num_tokens] -> final normed hidden [num_tokens, hidden] and, for each
        layer id in aux_layer_ids, the residual stream ENTERING that layer [num_tokens, hidden]
        (EAGLE-3's features; id == num_layers gives the stream before the final norm)."""
        freqs_cis = rope_freqs_cis(positions, self.inv_freq)
        hidden, residual = self.model.embed_tokens(input_ids), None
        aux: list[torch.Tensor] = []
        for layer_id, layer in enumerate(self.model.layers):
            if layer_id in aux_layer_ids:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, step, freqs_cis)
        if len(self.model.layers) in aux_layer_ids:
            aux.append(hidden + residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_logits, hidden] -> [num_logits, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            layer.self_attn.kv_cache = kv_cache


def checkpoint_names(param_name: str) -> list[tuple[str, object]]:
    """Inverse of map_checkpoint_name: the checkpoint tensors (with shard ids) that fill a parameter.

    "model.layers.0.mlp.gate_up_proj.weight" -> [("...gate_proj.weight", 0), ("...up_proj.weight", 1)]
    The routed experts' fused gate_up_proj is stored as is in checkpoints, so it maps to itself."""
    segments = param_name.split(".")
    if "experts" not in segments:
        names = [(ours, theirs, shard) for ours, theirs, shard in STACKED_PARAMS if ours in segments]
        if names:
            i = segments.index(names[0][0])
            return [(".".join(segments[:i] + [theirs] + segments[i + 1:]), shard) for _, theirs, shard in names]
    return [(param_name, None)]
