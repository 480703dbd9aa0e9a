"""EAGLE-3 draft head (arXiv 2503.01840) in the public checkpoint format used by the EAGLE authors,
vLLM and SGLang (`LlamaForCausalLMEagle3`).

One Llama decoder layer reads [input_layernorm(embed(token)) | hidden_norm(feature)] (2H wide) with
the feature as its residual; `norm` and `lm_head` then score a reduced draft vocabulary, mapped to
target ids by `d2t` (target_id = draft_id + d2t[draft_id]). The feature is `fc` over the target's
three captured hidden states on the first draft step, and the layer's own pre-norm output after.

Aux layer ids follow vLLM: id i is the residual stream ENTERING target layer i (transformers'
hidden_states[i]); default (2, L // 2, L - 3). SGLang configures ids one lower for the same layers;
such checkpoints load with aux_layer_offset=1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from warpspec.kernels import PagedAttentionMetadata, batch_invariant, l2_norm, paged_attention, write_kv_cache
from warpspec.workers.errors import CheckpointError
from warpspec.workers.layers import check_shape, empty_param
from warpspec.workers.model_config import ModelConfig


@dataclass
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    aux_layer_ids: tuple[int, int, int]

    @classmethod
    def from_pretrained(cls, path: str | Path, target: ModelConfig, aux_layer_offset: int = 0) -> Eagle3Config:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"draft checkpoint {path}: config.json not found")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
        architectures = raw.get("architectures") or []
        if "LlamaForCausalLMEagle3" not in architectures:
            raise CheckpointError(f"draft checkpoint {path}: architectures {architectures} is not "
                                  "LlamaForCausalLMEagle3")
        if raw.get("num_hidden_layers", 1) != 1:
            raise CheckpointError(f"draft checkpoint {path}: EAGLE-3 has one layer, config says "
                                  f"{raw['num_hidden_layers']}")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = target.num_hidden_layers
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or [2, layers // 2, layers - 3]
        ids = tuple(int(i) + aux_layer_offset for i in ids)
        config = cls(
            hidden_size=hidden,
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw.get("vocab_size", target.vocab_size)),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw.get("vocab_size", target.vocab_size)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0))),
            aux_layer_ids=ids,
        )
        config.check_against(target)
        return config

    def check_against(self, target: ModelConfig) -> None:
        if self.target_hidden_size != target.hidden_size:
            raise CheckpointError(f"draft expects target hidden size {self.target_hidden_size}, the target has "
                                  f"{target.hidden_size}")
        if self.hidden_size != target.hidden_size:
            raise CheckpointError(f"draft hidden_size {self.hidden_size} differs from the target's "
                                  f"{target.hidden_size}; the draft embeds tokens with the target's embeddings")
        if self.vocab_size != target.vocab_size:
            raise CheckpointError(f"draft vocab_size {self.vocab_size} differs from the target's {target.vocab_size}")
        if len(self.aux_layer_ids) != 3 or not all(0 <= i <= target.num_hidden_layers for i in self.aux_layer_ids):
            raise CheckpointError(f"draft aux layer ids {list(self.aux_layer_ids)} must be three ids in "
                                  f"0..{target.num_hidden_layers}")


def _rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama RoPE (the draft is a Llama layer): x [tokens, heads, dim], cos/sin [tokens, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config, embed_tokens: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = embed_tokens  # the target's [vocab, hidden], shared, not a parameter
        self.fc = empty_param(c.hidden_size, 3 * c.target_hidden_size, dtype=dtype)
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = empty_param(q_size, 2 * c.hidden_size, dtype=dtype)
        self.k_proj = empty_param(kv_size, 2 * c.hidden_size, dtype=dtype)
        self.v_proj = empty_param(kv_size, 2 * c.hidden_size, dtype=dtype)
        self.o_proj = empty_param(c.hidden_size, q_size, dtype=dtype)
        self.gate_proj = empty_param(c.intermediate_size, c.hidden_size, dtype=dtype)
        self.up_proj = empty_param(c.intermediate_size, c.hidden_size, dtype=dtype)
        self.down_proj = empty_param(c.hidden_size, c.intermediate_size, dtype=dtype)
        self.input_layernorm = empty_param(c.hidden_size, dtype=dtype)
        self.hidden_norm = empty_param(c.hidden_size, dtype=dtype)
        self.post_attention_layernorm = empty_param(c.hidden_size, dtype=dtype)
        self.norm = empty_param(c.hidden_size, dtype=dtype)
        self.lm_head = empty_param(c.draft_vocab_size, c.hidden_size, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, kv_heads, head_dim]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return l2_norm(x, self.config.rms_norm_eps) * weight

    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, attn_meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids, positions [num_tokens]; features [num_tokens, 3 * target_hidden] (the target's
        aux states) or [num_tokens, hidden] (the draft's own previous output). Returns draft-vocab
        logits [num_tokens, draft_vocab] float32 and the pre-norm output [num_tokens, hidden]."""
        return self.attend(*self.write_kv(token_ids, features, positions, slot_mapping), attn_meta)

    def write_kv(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first half of forward: store every position's KV; returns its queries [num_tokens,
        heads, head_dim] and residual. A catch-up needs the rest (attend) only at its last position."""
        q, k, v, residual = self.before_attention(token_ids, features, positions)
        write_kv_cache(k, v, self.kv_cache, slot_mapping)
        return q, residual

    def attend(self, q: torch.Tensor, residual: torch.Tensor,
               attn_meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The second half of forward, for the rows of q whose positions attn_meta describes."""
        attn = paged_attention(q, self.kv_cache[0], self.kv_cache[1], attn_meta, self.config.head_dim**-0.5, None)
        return self.after_attention(attn.reshape(attn.shape[0], -1), residual)

    def before_attention(self, token_ids: torch.Tensor, features: torch.Tensor,
                         positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tensors in, tensors out (so torch.compile can take it whole): q, k, v after RoPE, and the
        residual (the fused feature)."""
        c = self.config
        if features.shape[-1] != c.hidden_size:
            features = batch_invariant.linear(features, self.fc)
        x = torch.cat([self._rms(F.embedding(token_ids, self.embed_tokens), self.input_layernorm),
                       self._rms(features, self.hidden_norm)], dim=-1)
        n = x.shape[0]
        q = batch_invariant.linear(x, self.q_proj).view(n, c.num_attention_heads, c.head_dim)
        k = batch_invariant.linear(x, self.k_proj).view(n, c.num_key_value_heads, c.head_dim)
        v = batch_invariant.linear(x, self.v_proj).view(n, c.num_key_value_heads, c.head_dim)
        angles = positions[:, None].float() * self.inv_freq[None, :].to(positions.device)
        angles = torch.cat([angles, angles], dim=-1).to(batch_invariant.float_dtype(x))
        cos, sin = angles.cos(), angles.sin()
        return _rotate_half_rope(q, cos, sin), _rotate_half_rope(k, cos, sin), v, features

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = batch_invariant.linear(attn, self.o_proj) + residual
        normed = self._rms(hidden, self.post_attention_layernorm)
        act = batch_invariant.silu_mul(batch_invariant.linear(normed, self.gate_proj),
                                       batch_invariant.linear(normed, self.up_proj))
        prenorm = hidden + batch_invariant.linear(act, self.down_proj)
        return batch_invariant.linear(self._rms(prenorm, self.norm), self.lm_head).float(), prenorm

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        draft_ids = draft_ids.to(self.d2t.device)
        return draft_ids + self.d2t[draft_ids]

    def move_to(self, device: torch.device) -> Eagle3Draft:
        """Parameters and buffers, and the target's embeddings and the RoPE frequencies it holds as
        plain tensors, onto device."""
        self.to(device)
        self.embed_tokens = self.embed_tokens.to(device)
        self.inv_freq = self.inv_freq.to(device)
        return self


# Checkpoint tensor -> attribute. `embed_tokens.weight`, when a checkpoint carries one, must equal the
# target's; warpspec always embeds with the target's.
TENSOR_NAMES = {
    "fc.weight": "fc",
    "midlayer.self_attn.q_proj.weight": "q_proj", "midlayer.self_attn.k_proj.weight": "k_proj",
    "midlayer.self_attn.v_proj.weight": "v_proj", "midlayer.self_attn.o_proj.weight": "o_proj",
    "midlayer.mlp.gate_proj.weight": "gate_proj", "midlayer.mlp.up_proj.weight": "up_proj",
    "midlayer.mlp.down_proj.weight": "down_proj",
    "midlayer.input_layernorm.weight": "input_layernorm", "midlayer.hidden_norm.weight": "hidden_norm",
    "midlayer.post_attention_layernorm.weight": "post_attention_layernorm",
    "norm.weight": "norm", "lm_head.weight": "lm_head",
}


def load_eagle3(path: str | Path, target: ModelConfig, embed_tokens: torch.Tensor, dtype: torch.dtype,
                aux_layer_offset: int = 0) -> Eagle3Draft:
    path = Path(path)
    config = Eagle3Config.from_pretrained(path, target, aux_layer_offset)
    draft = Eagle3Draft(config, embed_tokens, dtype)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"draft checkpoint {path}: model.safetensors not found")
    pending = set(TENSOR_NAMES) | {"d2t"}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                tensor = f.get_tensor(name)
                if name == "t2d" or name == "embed_tokens.weight":
                    continue  # t2d is d2t's inverse; embeddings come from the target
                if name == "d2t":
                    check_shape(name, (config.draft_vocab_size,), tuple(tensor.shape))
                    draft.d2t.copy_(tensor.long())
                elif name in TENSOR_NAMES:
                    param = getattr(draft, TENSOR_NAMES[name])
                    check_shape(name, tuple(param.shape), tuple(tensor.shape))
                    param.data.copy_(tensor)
                else:
                    raise CheckpointError(f"unexpected tensor {name!r} in draft checkpoint {path}")
                pending.discard(name)
    except SafetensorError as e:
        raise CheckpointError(f"corrupt draft safetensors file {weights}: {e}") from None
    if pending:
        raise CheckpointError(f"draft checkpoint {path} is missing tensor {', '.join(sorted(pending))}")
    target_ids = torch.arange(config.draft_vocab_size) + draft.d2t
    if target_ids.min() < 0 or target_ids.max() >= target.vocab_size:
        raise CheckpointError(f"draft d2t maps draft ids outside the target vocabulary [0, {target.vocab_size})")
    return draft.eval()
