"""Tiny, randomly initialised Llama 4 checkpoints written by transformers itself: the references
every parity test compares against."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Shared by all configs; overrides pick out the feature each config exercises.
BASE_TEXT_CONFIG = dict(
    vocab_size=160, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    # A wide init makes logits peaked, so greedy comparisons are not decided by float noise near ties.
    initializer_range=0.2,
)


def make_text_checkpoint(path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    config = Llama4TextConfig(**{**BASE_TEXT_CONFIG, **overrides})
    model = Llama4ForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def make_multimodal_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A real Llama4ForConditionalGeneration (tiny vision tower included): tensors under
    language_model.*, config under text_config."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64,
                  pixel_shuffle_ratio=0.5)
    config = Llama4Config(text_config={**BASE_TEXT_CONFIG, **overrides}, vision_config=vision)
    Llama4ForConditionalGeneration(config).eval().save_pretrained(path)
    return path


def load_reference(path: Path):
    """The transformers model for a checkpoint folder, text part only, float32."""
    from transformers import Llama4ForCausalLM, Llama4ForConditionalGeneration

    config = json.loads((path / "config.json").read_text())
    if "text_config" in config:
        return Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).language_model.eval()
    return Llama4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] log-softmax of transformers' logits at every prompt position."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation that runs through eos (as warpspec's ignore_eos). min_new_tokens would not
    do: it forbids eos instead of passing it through."""
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, "the reference stopped early"
    return tokens


# A dense Llama (transformers' LlamaForCausalLM): the second model family, in the same tiny sizes.
BASE_LLAMA_CONFIG = dict(
    vocab_size=160, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, rope_theta=10000.0, initializer_range=0.2,
)


def make_llama_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**BASE_LLAMA_CONFIG, **overrides})).eval().save_pretrained(path)
    return path


def load_llama_reference(path: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
