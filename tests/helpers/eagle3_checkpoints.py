"""Random EAGLE-3 drafts written in the public checkpoint layout (LlamaForCausalLMEagle3)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_eagle3_checkpoint(path: Path, hidden: int, vocab: int, draft_vocab: int, heads: int = 4,
                           kv_heads: int = 2, intermediate: int = 64, aux_layer_ids: list[int] | None = None,
                           seed: int = 0, std: float = 0.2, with_embeddings: bool = False) -> Path:
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    # The draft vocabulary: every other target id from 3 up, so d2t is a real, non-trivial offset table.
    target_ids = torch.arange(3, 3 + 2 * draft_vocab, 2)[:draft_vocab]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    tensors = {
        "fc.weight": randn(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": randn(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": randn(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, intermediate),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": randn(draft_vocab, hidden),
        "d2t": target_ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    if with_embeddings:
        tensors["embed_tokens.weight"] = randn(vocab, hidden)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "target_hidden_size": hidden}
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_speculation_target(path: Path) -> Path:
    """The target the speculative-decoding tests draft for: 4 layers, chunked attention (0-2) and
    NoPE (3) both exercised, every second layer MoE; the draft reads the stream entering 1, 2 and 3."""
    from helpers.hf_checkpoints import make_text_checkpoint

    return make_text_checkpoint(path, num_hidden_layers=4, attention_chunk_size=8, floor_scale=4,
                                interleave_moe_layer_step=2)


def make_speculation_draft(path: Path) -> Path:
    """A random EAGLE-3 draft for make_speculation_target: half its vocabulary, its layers 1, 2, 3."""
    return make_eagle3_checkpoint(path, hidden=64, vocab=160, draft_vocab=64, aux_layer_ids=[1, 2, 3])
