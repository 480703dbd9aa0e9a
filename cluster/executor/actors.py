"""Ray actor shells: each holds one plain object and forwards calls to it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import ray
from ray.util.placement_group import PlacementGroup

from warpspec.config.engine import EngineConfig
from warpspec.core.messages import CoreInput, StepReply
from warpspec.executor.coordinator import Coordinator, ReplicaInfo
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

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        self.worker.warm_up(aux_layer_ids)

    def num_collectives(self) -> int:
        return self.worker.num_collectives()


# The coordinator is rank 0 as well: coordinator_options gives it bundle 0's CPU or GPU. The core's
# loop holds a thread of its own ("core") for the actor's life; the other calls (the replica's
# messages, timings, shutdown) run beside it, one at a time. `start` runs on the core's thread too, so
# that loading and warming rank 0 up and stepping it compute from one thread: a second thread's
# OpenMP pool made every step ~3.7x slower on 2 cores (workers/cpu_threads.py).
@ray.remote(concurrency_groups={"core": 1})
class CoordinatorActor:
    def __init__(self):
        self.coordinator: Coordinator | None = None

    @ray.method(concurrency_group="core")
    def start(self, config: EngineConfig, placement_group: PlacementGroup, first_bundle: int = 0) -> ReplicaInfo:
        self.coordinator = Coordinator(config, placement_group, first_bundle)
        return self.coordinator.info()

    def submit(self, message: CoreInput) -> None:
        self.coordinator.submit(message)

    @ray.method(num_returns="streaming", concurrency_group="core")
    def run_core(self) -> Iterator[StepReply]:
        yield from self.coordinator.run_core()

    def record_timings(self, enabled: bool) -> None:
        self.coordinator.record_timings(enabled)

    def take_timings(self):
        return self.coordinator.take_timings()

    def num_collectives(self) -> list[int]:
        return self.coordinator.num_collectives()

    def worker_pids(self) -> list[int]:
        return self.coordinator.worker_pids()

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if self.coordinator is not None:
            self.coordinator.shutdown()
            self.coordinator = None
