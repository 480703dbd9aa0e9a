"""The executor of a replica on Ray: its coordinator actor (which runs the engine core), the N workers
that actor drives, and their placement group. RemoteEngine steps the core through core_step; the
rest is what operators and benchmarks ask of a replica: step timings, process ids."""

from __future__ import annotations

import contextlib

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import remove_placement_group

from warpspec.config import EngineConfig
from warpspec.coordinator import DispatchTiming, coordinator_options, place_workers, unwrap_ray_errors
from warpspec.core_messages import StepReply
from warpspec.errors import WorkerDiedError
from warpspec.requests import NewRequest
from warpspec.workers.llama4 import check_parallel_layout
from warpspec.workers.model_config import ModelConfig


class RayExecutor:
    def __init__(self, config: EngineConfig):
        from warpspec.actors import CoordinatorActor
        from warpspec.ray_env import connect_ray

        # Reject an impossible split from config.json alone, before Ray or any weight is touched.
        self.model_config = ModelConfig.from_pretrained(config.model)
        check_parallel_layout(self.model_config, config.parallel.num_workers)
        connect_ray(config.run_dir)
        # Placed here, not in the coordinator, so the group outlives a coordinator that dies (place_workers).
        self.placement_group = place_workers(config)
        self.coordinator = None
        try:
            self.coordinator = CoordinatorActor.options(**coordinator_options(config, self.placement_group)).remote()
            self.info = unwrap_ray_errors(lambda: ray.get(self.coordinator.start.remote(config, self.placement_group)))
        except BaseException:
            self._release()
            raise
        self.num_blocks = self.info.num_blocks

    def core_step(self, adds: list[NewRequest], aborts: list[str]) -> StepReply:
        """One step of the engine core in the coordinator (coordinator.py)."""
        try:
            return unwrap_ray_errors(lambda: ray.get(self.coordinator.core_step.remote(adds, aborts)))
        except RayActorError as e:
            raise WorkerDiedError(f"the replica's coordinator died: {str(e).splitlines()[0]}") from None

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
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
