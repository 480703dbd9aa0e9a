"""The actor shell of ranks 1..N-1: it holds one ShardWorker and forwards calls to it (the
coordinator actor, rank 0's, is coordinator/actor.py's)."""

from __future__ import annotations

import contextlib

import ray

from warpspec.executor.compile_cache_store import shared_compile_cache
from warpspec.workers.worker import ShardWorker, WorkerConfig, WorkerInfo


@ray.remote
class ShardWorkerActor:
    def __init__(self):
        self.worker: ShardWorker | None = None

    def start(self, config: WorkerConfig) -> WorkerInfo:
        self.worker = ShardWorker(config)
        return self.worker.info()

    def execute(self, step_bytes: bytes) -> tuple[float, bytes]:
        return self.worker.execute(step_bytes)

    def warm_up(self, aux_layer_ids: list[int], share: tuple[str, dict[str, str]] | None) -> None:
        """share: the (key, fingerprint) of this rank's artifacts in the cluster's compile cache, or
        None when nothing compiles."""
        with contextlib.nullcontext() if share is None else shared_compile_cache(self.worker.compile_cache, *share):
            self.worker.warm_up(aux_layer_ids)

    def num_collectives(self) -> int:
        return self.worker.num_collectives()
