"""Write a Llama 4 model in the Hugging Face Llama4ForCausalLM layout (config.json + model.safetensors)
that transformers and warpspec both load: the bundled target, random checkpoints and trained ones."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from warpspec.workers.models.llama4 import Llama4Config, Llama4ForCausalLM

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config_dict(config: Llama4Config, dtype: torch.dtype) -> dict:
    """transformers 5.x spelling (rope_parameters)."""
    rope = {"rope_type": config.rope.rope_type, "rope_theta": config.rope.theta}
    if config.rope.rope_type != "default":
        rope.update(factor=config.rope.factor, low_freq_factor=config.rope.low_freq_factor,
                    high_freq_factor=config.rope.high_freq_factor,
                    original_max_position_embeddings=config.rope.original_max_position_embeddings)
    eos = config.eos_token_ids
    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "intermediate_size_mlp": config.intermediate_size_mlp,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "num_local_experts": config.num_local_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_layers": config.moe_layers,
        "no_rope_layers": config.no_rope_layers,
        "attention_chunk_size": config.attention_chunk_size,
        "use_qk_norm": config.use_qk_norm,
        "attn_temperature_tuning": config.attn_temperature_tuning,
        # transformers' strict config wants an int here whenever the value is one.
        "floor_scale": int(config.floor_scale) if config.floor_scale.is_integer() else config.floor_scale,
        "attn_scale": config.attn_scale,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": rope,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id,
        "dtype": DTYPE_NAMES[dtype],
    }


def checkpoint_state_dict(model: Llama4ForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under checkpoint names, stacked parameters split back into their parts."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        parts = model.checkpoint_names(name)
        if len(parts) == 1:
            tensors[name] = param.detach().contiguous()
            continue
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        for hf_name, shard_id in parts:
            offset, size = layer.shard_offsets[shard_id]
            tensors[hf_name] = param.detach()[offset : offset + size].contiguous()
    return tensors


def save_checkpoint(model: Llama4ForCausalLM, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = model.embedding_table().dtype
    save_file(checkpoint_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.config, dtype), indent=2) + "\n")
    generation = {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_ids}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
