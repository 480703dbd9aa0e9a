"""One rank's model runner: owns the model and its KV cache, and runs steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from warpspec.workers.kv_cache import CacheConfig, allocate_kv_cache
from warpspec.workers.loader import load_model
from warpspec.workers.step import StepInput


@dataclass
class StepOutput:
    logits: torch.Tensor  # [num_logits, vocab] float32, rows of step.logits_indices
    aux_hidden: list[torch.Tensor] = field(default_factory=list)  # each [num_tokens, hidden]


class ModelRunner:
    def __init__(self, model_dir: str | Path, dtype: str | torch.dtype = "auto",
                 cache_config: CacheConfig | None = None, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.cache_config = cache_config or CacheConfig()
        self.model = load_model(model_dir, dtype, self.device)
        self.config = self.model.config
        self.dtype = self.model.model.embed_tokens.weight.dtype
        self.num_blocks = self.cache_config.resolve_num_blocks(self.config, self.dtype)
        self.kv_caches = allocate_kv_cache(self.config, self.num_blocks, self.cache_config.block_size,
                                           self.dtype, self.device)
        self.model.bind_kv_cache(self.kv_caches)

    @torch.inference_mode()
    def execute(self, step: StepInput, aux_layer_ids: tuple[int, ...] = ()) -> StepOutput:
        step = step.to(self.device)
        hidden, aux = self.model(step.input_ids, step.positions, step, aux_layer_ids)
        logits = self.model.compute_logits(hidden[step.logits_indices])
        return StepOutput(logits=logits, aux_hidden=aux)
