"""What every model family's configuration holds, read from a Hugging Face `config.json`.

Each family (workers/models/) parses its own fields into a subclass of ModelConfig; the registry
(workers/models/registry.py) picks the family by the checkpoint's architecture. What lives here is
what the engine, the KV cache and the drafters read of any model: sizes, RoPE, special tokens, the
checkpoint's dtype and tensor layout, and which layers attend within a chunk.

Accepts both spellings transformers has used for RoPE: 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warpspec.workers.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# Sizes a checkpoint's config.json must give as positive integers (else tensors of negative size).
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "max_position_embeddings")


@dataclass
class RopeConfig:
    theta: float = 500000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(kw_only=True)
class ModelConfig:
    architecture: str  # the key of the model's family in workers/models/registry.py
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Layers that attend within chunks of this many positions (chunk_size says which); None: none do.
    attention_chunk_size: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    # Where the text model's tensors sit in the checkpoint: "" or, for a multimodal one,
    # "language_model.".
    tensor_prefix: str = ""

    def __post_init__(self) -> None:
        self.check_positive(_POSITIVE_INTS)
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def check_positive(self, names: tuple[str, ...]) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config.json: {name} must be a positive integer, got {value!r}")

    def chunk_size(self, layer_id: int) -> int | None:
        """The chunk layer layer_id attends within; None: full causal attention."""
        return None

    @staticmethod
    def common_fields(text: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
        """The fields every family reads the same way, from its text model's config (text) inside the
        whole config.json (raw: where special tokens and the dtype may sit instead). Defaults follow
        transformers' Llama configs."""

        def need(key: str) -> Any:
            if key not in text:
                raise CheckpointError(f"config.json is missing required key {key!r}")
            return text[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return dict(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096 * 32)),
            rope=parse_rope(text),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=as_id_list(text.get("eos_token_id", raw.get("eos_token_id"))),
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                            or raw.get("dtype") or "float32"),
        )


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint folder's config.json."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model folder {str(path)!r} does not exist")
    return _read_json_object(path / "config.json")


def generation_eos_token_ids(model_dir: str | Path) -> list[int] | None:
    """generation_config.json's eos_token_id, which wins over config.json's (as in transformers'
    generate); None without one."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return None
    eos = _read_json_object(path).get("eos_token_id")
    return None if eos is None else as_id_list(eos)


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a Hugging Face checkpoint needs config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def parse_rope(text: dict[str, Any]) -> RopeConfig:
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
