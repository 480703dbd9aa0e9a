"""The replica's handle on its coordinator actor (coordinator.py: the engine core and rank 0) and the
placement group of its ranks. RayCoreClient sends the core its requests through it (submit,
fire-and-forget) and reads the core's replies from one stream (next_reply); the rest is what
operators and benchmarks ask of a replica: step timings, process ids."""

from __future__ import annotations

import contextlib
import time

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group

from warpspec.config.engine import EngineConfig
from warpspec.coordinator.actor import CoordinatorActor
from warpspec.core.messages import CoreInput, StepReply
from warpspec.core.requests import check_kv_capacity
from warpspec.core.startup import StartupPhase, StartupTimer
from warpspec.errors import EngineError, WorkerDiedError
from warpspec.executor.driver import DispatchTiming
from warpspec.executor.placement import coordinator_options, place_workers, replica_gang
from warpspec.executor.ray_env import connect_ray, unwrap_ray_errors
from warpspec.workers.models.registry import load_model_config, model_class_of


class CoordinatorHandle:
    def __init__(self, config: EngineConfig):
        # Reject an impossible split from config.json alone, before Ray or any weight is touched.
        self.model_config = load_model_config(config.model)
        model_class_of(self.model_config).check_parallel_layout(
            self.model_config, config.parallel.num_workers, config.parallel.moe_parallel)
        check_kv_capacity(config, self.model_config)
        connect_ray(config.run_dir)
        # A served replica's ranks come with it in Serve's gang (bundles 1..N); elsewhere they are placed
        # here, not in the coordinator, so the group outlives a coordinator that dies (place_workers).
        gang = replica_gang(config)
        self.owns_group = gang is None
        self.startup = StartupTimer()
        with self.startup.phase("placement") as phase:
            self.placement_group, first_bundle = (place_workers(config), 0) if gang is None else (gang, 1)
            phase.detail = "the workers' placement group" if gang is None else "Serve's gang"
        self.coordinator = None
        try:
            options = coordinator_options(config, self.placement_group, first_bundle)
            start = time.perf_counter()
            self.coordinator = CoordinatorActor.options(**options).remote()
            self.info = unwrap_ray_errors(lambda: ray.get(
                self.coordinator.start.remote(config, self.placement_group, first_bundle)))
        except BaseException:
            self._release()
            raise
        # What the coordinator did not time itself: its process starting and importing.
        inside = sum(p.seconds for p in self.info.startup)
        self.startup.phases.append(StartupPhase("coordinator process", round(time.perf_counter() - start - inside, 3),
                                                "actor start and imports"))
        self.startup.phases.extend(self.info.startup)
        self.num_blocks = self.info.num_blocks

        # The core's loop runs from here on, replying once per step until shutdown.
        self.replies = self.coordinator.run_core.remote()

    def submit(self, message: CoreInput) -> None:
        """Requests added and aborted, for the core's next step. Returns at once: a dead coordinator
        shows on the stream, not here."""
        self.coordinator.submit.remote(message)

    def next_reply(self) -> StepReply:
        """The core's next reply, blocking until its step is done."""
        try:
            return ray.get(next(self.replies))
        except Exception as e:  # noqa: BLE001 - mapped to the error the replica should see
            raise core_error(e) from None

    def record_timings(self, enabled: bool = True) -> None:
        """Have the coordinator keep each step's DispatchTiming (benchmarks; off by default)."""
        ray.get(self.coordinator.record_timings.remote(enabled))

    def take_timings(self) -> list[DispatchTiming]:
        return ray.get(self.coordinator.take_timings.remote())

    def num_collectives(self) -> list[int]:
        return ray.get(self.coordinator.num_collectives.remote())

    def worker_pids(self) -> list[int]:
        return ray.get(self.coordinator.worker_pids.remote())

    def coordinator_pid(self) -> int:
        return ray.get(self.coordinator.pid.remote())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Release the coordinator, its workers and their placement group. A dead coordinator cannot
        answer; removing the group kills any worker still in it."""
        if self.coordinator is not None:
            with contextlib.suppress(Exception):
                ray.get(self.coordinator.shutdown.remote(), timeout=timeout_s)
        self._release()

    def _release(self) -> None:
        if self.coordinator is not None:
            ray.kill(self.coordinator)
            self.coordinator = None
        if self.placement_group is not None and self.owns_group:  # Serve's gang goes with the replica
            remove_placement_group(self.placement_group)
        self.placement_group = None


def core_error(error: Exception) -> Exception:
    """What the replica should see for an error reading the core's stream: the core's own error (a
    dead worker's WorkerDiedError, a bug) rather than Ray's wrapper around it."""
    if isinstance(error, StopIteration):  # shutdown ended the core's loop
        return EngineError("the engine core has stopped: the replica is shutting down")
    if isinstance(error, RayTaskError) and error.cause is not None and not isinstance(error.cause, RayActorError):
        return error.cause
    if isinstance(error, RayActorError | RayTaskError):
        return WorkerDiedError(f"the replica's coordinator died: {str(error).splitlines()[0]}")
    return error
