"""The coordinator of one model replica: the process where its engine core runs, beside rank 0.

    replica (RayCoreClient)              Coordinator (in CoordinatorActor)          ranks 1..N-1
    submit(CoreInput) ---fire&forget-->  CoreLoop: inbox, then EngineCore.step()
                                         DriverExecutor: rank 0's shard, here <----> their shards
                                         sample / verify on rank 0's logits, the draft proposes
    next reply  <------- stream -------  StepReply: token ids, finish reasons, logprobs

It creates its workers itself, so a replica is one coordinator handle however many GPUs it spans.
Rank 0's logits and hidden states never leave this process, and no text is made here: the replica
detokenizes and checks stop strings (entrypoints/output_processor.py).

Coordinator is a plain class that builds the three in order; CoordinatorActor hosts it in a Ray actor
(in bundle 0, with rank 0's GPU), the loop in a thread of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup

from warpspec.config.engine import EngineConfig
from warpspec.core.core_loop import CoreLoop
from warpspec.core.engine_core import EngineCore
from warpspec.core.messages import CoreInput, StepReply
from warpspec.core.startup import StartupPhase, StartupTimer, show_startup_log
from warpspec.executor.compile_cache_store import compile_cache_key, shared_compile_cache
from warpspec.executor.driver import DispatchTiming, DriverExecutor
from warpspec.workers.worker import WorkerInfo

SHUTDOWN_WAIT_S = 30.0  # for the core's step in progress


@dataclass
class ReplicaInfo:
    num_workers: int
    num_blocks: int
    workers: list[WorkerInfo]
    dispatch: str
    draft_aux_layer_ids: tuple[int, ...] | None = None  # when the coordinator runs an EAGLE-3 draft
    startup: list[StartupPhase] = field(default_factory=list)  # the coordinator's start-up phases


class Coordinator:
    def __init__(self, config: EngineConfig, placement_group: PlacementGroup, first_bundle: int = 0):
        """placement_group: one bundle per rank from first_bundle on (DriverExecutor says whose)."""
        self.executor, self.loop = None, None
        startup = StartupTimer()
        try:
            with startup.phase("weights and KV cache") as phase:
                self.executor = DriverExecutor(config, placement_group, first_bundle)
                n = config.parallel.num_workers
                phase.detail = f"{n} rank{'s' if n > 1 else ''}, {self.executor.num_blocks} KV blocks each"
            # The core warms every rank up (EngineCore's warm-up) before the step graph exists: once
            # compiled, the Ray graph holds each worker's thread. It loads the draft too, when config names one.
            with self._shared_compile_cache(config):
                self.core = EngineCore(config, self.executor, startup=startup)
            self.executor.start_step_graph()
            self.loop = CoreLoop(self.core, config.parallel.core_reply_interval_ms, self.executor.record_core_time)
        except BaseException:
            self.shutdown()  # a half-built replica must not keep its actors
            raise

    def _shared_compile_cache(self, config: EngineConfig):
        """Rank 0's and the draft's artifacts, fetched from and published to the cluster
        (executor/compile_cache_store.py), when anything compiles."""
        if config.enforce_eager:
            return contextlib.nullcontext()
        return shared_compile_cache(self.executor.rank0.compile_cache, *compile_cache_key(config, "coordinator"))

    def info(self) -> ReplicaInfo:
        executor, proposer = self.executor, self.core.proposer
        return ReplicaInfo(executor.parallel.num_workers, executor.num_blocks, executor.infos,
                           executor.parallel.dispatch,
                           tuple(proposer.aux_layer_ids) if proposer is not None else None,
                           self.core.startup.phases)

    def shutdown(self) -> None:
        """End the core's loop (after the step it is in), then release the workers."""
        if self.loop is not None:
            self.loop.close(SHUTDOWN_WAIT_S)
        if self.executor is not None:
            self.executor.shutdown()


# The coordinator is rank 0 as well: placement.coordinator_options gives it bundle 0's CPU or GPU. The
# core's loop holds a thread of its own ("core") for the actor's life; the other calls (the replica's
# messages, timings, shutdown) run beside it, one at a time. `start` runs on the core's thread too, so
# that loading and warming rank 0 up and stepping it compute from one thread: a second thread's
# OpenMP pool made every step ~3.7x slower on 2 cores (workers/compile/cpu_threads.py).
@ray.remote(concurrency_groups={"core": 1})
class CoordinatorActor:
    def __init__(self):
        self.coordinator: Coordinator | None = None

    @ray.method(concurrency_group="core")
    def start(self, config: EngineConfig, placement_group: PlacementGroup, first_bundle: int = 0) -> ReplicaInfo:
        show_startup_log()
        self.coordinator = Coordinator(config, placement_group, first_bundle)
        return self.coordinator.info()

    def submit(self, message: CoreInput) -> None:
        self.coordinator.loop.submit(message)

    @ray.method(num_returns="streaming", concurrency_group="core")
    def run_core(self) -> Iterator[StepReply]:
        yield from self.coordinator.loop.run()

    def record_timings(self, enabled: bool) -> None:
        self.coordinator.executor.record_timings(enabled)

    def take_timings(self) -> list[DispatchTiming]:
        return self.coordinator.executor.take_timings()

    def num_collectives(self) -> list[int]:
        return self.coordinator.executor.num_collectives()

    def worker_pids(self) -> list[int]:
        return self.coordinator.executor.worker_pids()

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if self.coordinator is not None:
            self.coordinator.shutdown()
            self.coordinator = None
