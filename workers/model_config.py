"""Llama 4 text model configuration, read from a Hugging Face `config.json`.

Accepts both spellings transformers has used: 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters`), and the multimodal `Llama4ForConditionalGeneration` config that nests the
text model under `text_config`. Defaults follow transformers' `Llama4TextConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warpspec.workers.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
SUPPORTED_MODEL_TYPES = ("llama4_text", "llama4")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


# Sizes a checkpoint's config.json must give as positive integers (else tensors of negative size).
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
                  "max_position_embeddings")


@dataclass
class RopeConfig:
    theta: float = 500000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    intermediate_size_mlp: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    moe_layers: list[int]
    no_rope_layers: list[int]
    attention_chunk_size: int | None
    use_qk_norm: bool
    attn_temperature_tuning: bool
    floor_scale: float
    attn_scale: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    # "" for Llama4ForCausalLM, "language_model." for the multimodal checkpoint layout.
    tensor_prefix: str = ""

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise CheckpointError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_local_experts ({self.num_local_experts})"
            )
        if len(self.no_rope_layers) < self.num_hidden_layers:
            raise CheckpointError(
                f"no_rope_layers has {len(self.no_rope_layers)} entries, fewer than "
                f"num_hidden_layers ({self.num_hidden_layers})"
            )
        chunk = self.attention_chunk_size
        chunked = [i for i in range(self.num_hidden_layers) if self.uses_rope(i)]
        if chunked and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            # transformers reads a missing key as 8192 (from_dict does too); null or 0 is no chunk at all.
            raise CheckpointError(f"config.json: attention_chunk_size must be a positive integer when layers "
                                  f"use chunked attention (no_rope_layers marks layers {chunked[:8]}"
                                  f"{' ...' if len(chunked) > 8 else ''}), got {chunk!r}")
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise CheckpointError(f"moe_layers {bad} outside 0..{self.num_hidden_layers - 1}")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layers

    def uses_rope(self, layer_id: int) -> bool:
        # transformers' naming is inverted: no_rope_layers[i] == 1 means layer i DOES use RoPE.
        return bool(self.no_rope_layers[layer_id])

    def chunk_size(self, layer_id: int) -> int | None:
        """Local-attention chunk for RoPE layers; None (full causal) for NoPE layers."""
        return self.attention_chunk_size if self.uses_rope(layer_id) else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if architectures and not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
            raise CheckpointError(
                f"unsupported architecture {architectures}; warpspec serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if not architectures and model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r}; warpspec serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        is_multimodal = "text_config" in raw or "Llama4ForConditionalGeneration" in architectures
        text = raw.get("text_config", raw) if is_multimodal else raw
        if not isinstance(text, dict):
            raise CheckpointError("config.json: text_config must be an object")

        def need(key: str) -> Any:
            if key not in text:
                raise CheckpointError(f"config.json is missing required key {key!r}")
            return text[key]

        num_layers = int(need("num_hidden_layers"))
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
        interval = int(text.get("no_rope_layer_interval", 4))
        no_rope_layers = text.get("no_rope_layers") or [
            int((i + 1) % interval != 0) for i in range(num_layers)
        ]
        step = int(text.get("interleave_moe_layer_step", 1))
        moe_layers = text.get("moe_layers")
        if moe_layers is None:
            moe_layers = list(range(step - 1, num_layers, step))
        intermediate = int(text.get("intermediate_size", 8192))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=intermediate,
            intermediate_size_mlp=int(text.get("intermediate_size_mlp", 16384)),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(text.get("head_dim") or hidden // num_heads),
            num_local_experts=int(text.get("num_local_experts", 16)),
            num_experts_per_tok=int(text.get("num_experts_per_tok", 1)),
            moe_layers=[int(i) for i in moe_layers],
            no_rope_layers=[int(x) for x in no_rope_layers],
            attention_chunk_size=text.get("attention_chunk_size", 8192),
            use_qk_norm=bool(text.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(text.get("attn_temperature_tuning", True)),
            floor_scale=float(text.get("floor_scale", 8192)),
            attn_scale=float(text.get("attn_scale", 0.1)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096 * 32)),
            rope=_parse_rope(text),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=_as_id_list(eos),
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                            or raw.get("dtype") or "float32"),
            tensor_prefix="language_model." if is_multimodal else "",
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise CheckpointError(f"model folder {str(path)!r} does not exist")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} not found: a Hugging Face checkpoint needs config.json")
        try:
            raw = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{config_path} must hold a JSON object")
        config = cls.from_dict(raw)
        generation_config = path / "generation_config.json"
        if generation_config.is_file():
            # generation_config.json wins over config.json for eos, as in transformers' generate.
            try:
                eos = json.loads(generation_config.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{generation_config} is not valid JSON: {e}") from None
            if eos is not None:
                config.eos_token_ids = _as_id_list(eos)
        return config


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _parse_rope(text: dict[str, Any]) -> RopeConfig:
    # 5.x: rope_parameters = {"rope_type", "rope_theta", ...}; 4.x: rope_theta + rope_scaling.
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", text.get("rope_theta", 500000.0))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", text.get("max_position_embeddings", 8192))
        ),
    )
