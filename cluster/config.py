"""Engine configuration: one dataclass per concern, gathered under EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from warpspec.workers.kv_cache import CacheConfig


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences decoding together in one step

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # "auto" (the checkpoint's), "float32", "bfloat16", "float16"
    # None: the checkpoint's max_position_embeddings. Prompt + output never exceed it.
    max_model_len: int | None = None
    device: str = "cpu"
    seed: int = 0  # seeds requests that bring no seed of their own
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
