"""Randomly initialised Llama 4 checkpoints with a real tokenizer, for demos, smoke tests and
benchmarks on machines that cannot download weights. The text they generate is noise."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from warpspec.training.bpe import train_bpe
from warpspec.workers.checkpoint_writer import save_checkpoint
from warpspec.workers.models.llama4 import Llama4ForCausalLM
from warpspec.workers.models.registry import model_config_from_dict

# Named shapes: MoE on every other layer, layer 3 NoPE, GQA 4:1, chunked attention.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                 num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                 attention_chunk_size=64, max_position_embeddings=1024),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=256, intermediate_size_mlp=512,
                  num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                  num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
                  attention_chunk_size=256, max_position_embeddings=4096),
}


def train_demo_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the Python standard library's own sources (always on disk)."""
    stdlib = Path(sys.modules["os"].__file__).parent
    return train_bpe([p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:60]], vocab_size)


def create_random_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0,
                             dtype: torch.dtype = torch.float32, std: float = 0.1, **overrides) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    raw = {**PRESETS[preset], **overrides, "architectures": ["Llama4ForCausalLM"],
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    config = model_config_from_dict(raw)
    model = Llama4ForCausalLM(config, dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    out = Path(out_dir)
    save_checkpoint(model, out)
    tokenizer = train_demo_tokenizer(config.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    return out
