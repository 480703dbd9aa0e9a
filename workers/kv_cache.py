"""Paged KV cache: tensors [2, num_blocks, block_size, num_kv_heads, head_dim], keys then values, one
per layer, or with a hybrid cache one per layer of a KV group (kv_groups.py). Which blocks a sequence
owns is the engine's bookkeeping (its block tables)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from warpspec.workers.kv_groups import kv_bytes_per_token_layer, kv_group_layout
from warpspec.workers.model_config import ModelConfig

DEFAULT_MEMORY_GIB = 1.0
MEMORY_ENV = "WARPSPEC_KV_CACHE_MEMORY_GIB"


def default_memory_gib() -> float:
    """DEFAULT_MEMORY_GIB, or the GiB WARPSPEC_KV_CACHE_MEMORY_GIB names: a default for programs that
    build many short-lived engines (the test suite), since an engine writes its whole cache once at
    start (zeroed: a CPU took ~0.3 s a GiB)."""
    raw = os.environ.get(MEMORY_ENV)
    if raw is None:
        return DEFAULT_MEMORY_GIB
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"{MEMORY_ENV} must be a positive number of GiB, got {raw!r}")
    return gib


@dataclass
class CacheConfig:
    block_size: int = 16
    # None sizes the cache from memory_gib; an explicit count is for tests and tight budgets. A block
    # is block_size tokens of every layer; a hybrid cache (kv_groups.py) splits each into one page
    # per KV group, so the same memory holds num_blocks x groups of its blocks.
    num_blocks: int | None = None
    memory_gib: float = field(default_factory=default_memory_gib)
    # Chunked-attention layers keep only their chunk's KV (kv_groups.py), for checkpoints that have them.
    hybrid: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.memory_gib <= 0:
            raise ValueError(f"memory_gib must be positive, got {self.memory_gib}")

    def bytes_per_block(self, config: ModelConfig, num_kv_heads: int, dtype: torch.dtype) -> int:
        num_tensors = kv_group_layout(config, self.hybrid).num_tensors
        return num_tensors * self.block_size * kv_bytes_per_token_layer(config, dtype.itemsize, num_kv_heads)

    def resolve_num_blocks(self, config: ModelConfig, num_kv_heads: int, dtype: torch.dtype) -> int:
        """The blocks of the cache's layout: memory_gib is per rank; num_kv_heads is the rank's share."""
        if self.num_blocks is not None:
            return self.num_blocks * len(kv_group_layout(config, self.hybrid).groups)
        return max(1, int(self.memory_gib * 2**30) // self.bytes_per_block(config, num_kv_heads, dtype))


def allocate_kv_cache(config: ModelConfig, num_kv_heads: int, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device | str,
                      num_tensors: int | None = None) -> list[torch.Tensor]:
    """num_tensors: the layout's (kv_groups.py); one per layer by default."""
    shape = (2, num_blocks, block_size, num_kv_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_tensors or config.num_hidden_layers)]
