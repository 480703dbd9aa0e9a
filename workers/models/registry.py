"""The model families warpspec serves, keyed by the architecture a checkpoint's config.json names.

Each family is one module of this package: its config (a ModelConfig parsed from config.json), its
model (a DecoderForCausalLM composing decoder.py's layers) and how its checkpoints name and lay out
tensors. Nothing outside this package names a family: the loader, the runner, the executors and the
drafters ask the registry for a checkpoint's config and model class. Adding a family is its module
and one line of FAMILIES.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from warpspec.workers.errors import CheckpointError
from warpspec.workers.model_config import ModelConfig, generation_eos_token_ids, read_config_json
from warpspec.workers.models import llama, llama4
from warpspec.workers.models.decoder import DecoderForCausalLM

# family module -> its causal LM; the module names the architectures and model types it reads.
FAMILIES = {
    llama4: llama4.Llama4ForCausalLM,
    llama: llama.LlamaForCausalLM,
}
ARCHITECTURES = {architecture: model for family, model in FAMILIES.items() for architecture in family.ARCHITECTURES}
MODEL_TYPES = {model_type: model for family, model in FAMILIES.items() for model_type in family.MODEL_TYPES}


def model_class(raw: dict[str, Any]) -> type[DecoderForCausalLM]:
    """The causal LM a config.json's architectures name (or, naming none, its model_type); anything
    else is refused, naming what is served."""
    architectures = raw.get("architectures") or []
    for architecture in architectures:
        if architecture in ARCHITECTURES:
            return ARCHITECTURES[architecture]
    if architectures:
        raise CheckpointError(f"unsupported architecture {architectures}; warpspec serves "
                              f"{', '.join(ARCHITECTURES)}")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"unsupported model_type {model_type!r} (and no architectures); warpspec serves "
                              f"{', '.join(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """A config.json's contents parsed by the family that serves its architecture."""
    return model_class(raw).config_class.from_dict(raw)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """A checkpoint folder's model config, before any weight is read; generation_config.json's
    eos_token_id wins over config.json's."""
    config = model_config_from_dict(read_config_json(model_dir))
    eos = generation_eos_token_ids(model_dir)
    if eos is not None:
        config.eos_token_ids = eos
    return config


def model_class_of(config: ModelConfig) -> type[DecoderForCausalLM]:
    return ARCHITECTURES[config.architecture]
