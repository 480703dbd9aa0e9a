"""The executor of a replica on Ray: rank 0 here (vLLM's and SGLang's driver worker), ranks 1..N-1 in
worker actors it places and drives, all joined in one collective group. It runs inside the
coordinator actor (coordinator/actor.py), whose engine core calls execute() once per step; rank 0's
logits and hidden states never leave this process.

    engine core (same process)      DriverExecutor = rank 0                 ranks 1..N-1 (actors.py)
    execute(StepPlan) ------------> a BatchUpdate (persistent_batch.py) ---> their shards
                                    rank 0's shard, here <------collectives------> (no logits back)
    StepOutput: rank 0's logits <-- and the hidden states the draft reads

With more than one rank, each step reaches the workers through a Ray Compiled Graph (or plain actor
calls: ParallelConfig.dispatch).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass

import ray
import torch
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import RayActorError, RayChannelError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from warpspec.config.engine import EngineConfig
from warpspec.errors import WorkerDiedError
from warpspec.executor.actors import ShardWorkerActor
from warpspec.executor.compile_cache_store import compile_cache_key
from warpspec.executor.placement import worker_resources
from warpspec.executor.ray_env import unwrap_ray_errors
from warpspec.workers.distributed.comm import CollectiveError, CommInit, make_nccl_unique_id
from warpspec.workers.distributed.shm_comm import shared_memory_available
from warpspec.workers.models.registry import load_model_config, model_class_of
from warpspec.workers.persistent_batch import BatchMirror
from warpspec.workers.step import StepOutput, StepPlan
from warpspec.workers.worker import ShardWorker, WorkerConfig, WorkerInfo, address_and_free_port

MAX_TIMINGS = 100_000  # steps of DispatchTiming kept while recording: ~10 MB at most


@dataclass
class DispatchTiming:
    wall_s: float  # from sending the step to holding every worker's reply
    slowest_compute_s: float  # the longest any worker spent inside execute
    step_bytes: int = 0  # the step message sent to each of ranks 1..N-1
    reply_bytes: int = 0  # the largest reply of ranks 1..N-1 (rank 0's logits stay in this process)
    core_s: float = 0.0  # the whole core pass around it: admitting, scheduling, dispatch, sampling, the draft


class DriverExecutor:
    def __init__(self, config: EngineConfig, placement_group: PlacementGroup, first_bundle: int = 0):
        """placement_group: one bundle per rank from first_bundle on (placement.place_workers' own group,
        or the gang Serve placed the replica in: placement.serving_bundles), made and removed by whoever
        holds the coordinator, so that it outlives a coordinator that dies. Call start_step_graph once
        the engine core has warmed every rank up."""
        self.config = config
        self.parallel = config.parallel
        self.is_gpu = config.device.startswith("cuda")
        self.model_config = load_model_config(config.model)
        model_class_of(self.model_config).check_parallel_layout(
            self.model_config, self.parallel.num_workers, self.parallel.moe_parallel)
        self.placement_group, self.first_bundle = placement_group, first_bundle
        self.workers, self.graph, self.rank0 = [], None, None  # self.workers: ranks 1..N-1
        self.mirror = BatchMirror()  # what ranks 1..N-1 hold of the batch
        # Filled only while a benchmark asks (record_timings): a replica runs for months, one entry a step.
        self.timings: deque[DispatchTiming] | None = None
        self.pass_timing: DispatchTiming | None = None  # this core pass's step, for record_core_time
        self.is_broken = False
        try:
            num_workers = self.parallel.num_workers
            self.workers = [self._create_worker(rank) for rank in range(1, num_workers)]
            self.rank0, self.infos = self._start_shards()
            self.num_blocks = min(i.num_blocks for i in self.infos)
        except BaseException:
            self.shutdown()  # a half-built replica must not keep its actors
            raise

    # ---- setup ----------------------------------------------------------------------------------

    def _create_worker(self, rank: int):
        strategy = PlacementGroupSchedulingStrategy(self.placement_group,
                                                    placement_group_bundle_index=self.first_bundle + rank)
        return ShardWorkerActor.options(scheduling_strategy=strategy, **worker_resources(self.config, rank)).remote()

    def _comm_backend(self) -> str:
        backend = self.parallel.comm_backend
        if self.parallel.num_workers == 1:
            return "local"
        if backend == "auto":
            return "nccl" if self.is_gpu else "shm" if self._ranks_share_a_host() else "gloo"
        return backend

    def _ranks_share_a_host(self) -> bool:
        """Whether shared memory reaches every rank: x86-64 with a /dev/shm here, and every worker's
        bundle on this node (a served replica's gang always is; LLM's PACK or SPREAD placement may not be)."""
        nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        return shared_memory_available() and all(nodes.get(self.first_bundle + rank) == here
                                                 for rank in range(1, self.parallel.num_workers))

    def _start_shards(self) -> tuple[ShardWorker, list[WorkerInfo]]:
        """Rank 0 here, hosting the group's rendezvous; ranks 1..N-1 in their actors."""
        address, port = address_and_free_port()
        backend = self._comm_backend()
        nccl_id = make_nccl_unique_id() if backend == "nccl" else b""
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        threads = 0 if self.is_gpu else max(1, min(os.cpu_count() or 1, cpus) // self.parallel.num_workers)
        configs = [WorkerConfig(self.config.model, self.config.dtype, self.config.cache,
                                CommInit(backend, rank, self.parallel.num_workers, address, port, nccl_id),
                                self.config.device, threads,
                                self.config.cuda_graph_config(), self.config.quantization,
                                self.parallel.moe_parallel, self.config.deterministic, self.config.run_dir,
                                self.config.compile_cache)
                   for rank in range(self.parallel.num_workers)]
        # Every rank must enter the group together: start the others, join here, then wait for them.
        started = [w.start.remote(c) for w, c in zip(self.workers, configs[1:], strict=True)]
        rank0 = ShardWorker(configs[0])
        return rank0, [rank0.info(), *unwrap_ray_errors(lambda: ray.get(started))]

    def start_step_graph(self) -> None:
        """Compile the Ray graph that sends each step to ranks 1..N-1 (ParallelConfig.dispatch). Once
        compiled, it holds each worker's thread, and the workers take no other calls: warm them up first."""
        if self.parallel.dispatch != "compiled" or not self.workers:
            return
        with InputNode() as step:
            graph = MultiOutputNode([w.execute.bind(step) for w in self.workers])
        self.graph = graph.experimental_compile()

    # ---- the step -------------------------------------------------------------------------------

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        """Every rank builds its compiled step graphs (ModelRunner.warm_up) at once: the warm-up steps
        meet in their collectives. Ranks 1..N-1 fetch and publish their artifacts through the
        cluster (compile_cache_store.py); rank 0's are the coordinator's."""
        shares = [None if self.config.enforce_eager else compile_cache_key(self.config, f"rank{rank}")
                  for rank in range(1, self.parallel.num_workers)]
        pending = [w.warm_up.remote(aux_layer_ids, share) for w, share in zip(self.workers, shares, strict=True)]
        self.rank0.warm_up(aux_layer_ids)
        unwrap_ray_errors(lambda: ray.get(pending))

    def embedding_table(self) -> torch.Tensor | None:
        """Rank 0's, which is whole with one rank only (the draft then shares it, EngineCore)."""
        return self.rank0.runner.embedding_table()

    def execute(self, plan: StepPlan) -> StepOutput:
        """The engine's executor: one step on every rank. Ranks 1..N-1 get it as an update to the
        batch they keep (persistent_batch.py); rank 0 runs it here, meeting them in the step's
        collectives, and its logits and hidden states stay."""
        if self.is_broken:
            raise WorkerDiedError("a worker of this replica died earlier; the replica must be rebuilt")
        step = plan.build()
        step_bytes = b""
        if self.workers:
            step_bytes = self.mirror.update(plan.seqs, plan.block_size, plan.aux_layer_ids,
                                           plan.left_request_ids, plan.chunk_size).to_bytes()
        start = time.perf_counter()
        try:
            output, replies = self._run_step(step, step_bytes)
        except BaseException:
            # Some rank may not have applied the update: the next one sends the batch whole.
            self.mirror.needs_reset = True
            raise
        if self.timings is not None:
            slowest = max([output.compute_s, *(compute_s for compute_s, _ in replies)])
            self.pass_timing = DispatchTiming(time.perf_counter() - start, slowest, len(step_bytes),
                                              max((len(r) for _, r in replies), default=0))
            self.timings.append(self.pass_timing)
        return output

    def _run_step(self, step, step_bytes: bytes) -> tuple[StepOutput, list]:
        try:
            if self.graph is not None:
                pending = self.graph.execute(step_bytes)
            else:
                pending = [w.execute.remote(step_bytes) for w in self.workers]
            output = self.rank0.execute_step(step)
            replies = ray.get(pending) if self.workers else []
        except CollectiveError as e:  # rank 0's collective broke: a peer died, or failed its part
            self.is_broken = True
            raise WorkerDiedError(f"a worker of this replica died during a step: {e}") from None
        except (RayActorError, RayTaskError, RayChannelError) as e:
            # A rank whose peer died usually reports the broken collective before Ray reports the dead
            # actor, and a Compiled Graph whose actor died reports a closed channel: all mean the
            # replica is gone.
            if isinstance(e, RayTaskError) and not isinstance(e.cause, RayActorError | CollectiveError):
                raise e.cause from None
            self.is_broken = True
            raise WorkerDiedError(f"a worker of this replica died during a step: {str(e).splitlines()[0]}") from None
        except Exception as e:
            if not self.rank0.comm.abandoned:
                raise
            # Rank 0 failed part-way and abandoned the group (failing_together): its peers ended the
            # step with it, and their collectives no longer pair up with its own.
            self.is_broken = True
            first_line = (str(e).splitlines() or [""])[0][:200]
            raise WorkerDiedError(f"rank 0 failed its part of a step ({type(e).__name__}: {first_line}); "
                                  "the replica must be rebuilt") from e
        return output, replies

    def record_timings(self, enabled: bool) -> None:
        """Start (or stop) keeping each step's DispatchTiming, the last MAX_TIMINGS of them."""
        self.timings = deque(maxlen=MAX_TIMINGS) if enabled else None

    def record_core_time(self, core_s: float) -> None:
        """The core pass that ran this step took core_s (CoreLoop's on_pass); passes without one are not timed."""
        if self.pass_timing is not None:
            self.pass_timing.core_s = core_s
            self.pass_timing = None

    def take_timings(self) -> list[DispatchTiming]:
        """The timings kept since the last call (none unless record_timings(True))."""
        if self.timings is None:
            return []
        timings = list(self.timings)
        self.timings.clear()
        return timings

    def num_collectives(self) -> list[int]:
        """Per rank, the collectives it has run."""
        return [self.rank0.comm.num_collectives, *ray.get([w.num_collectives.remote() for w in self.workers])]

    def worker_pids(self) -> list[int]:
        return [info.pid for info in self.infos]

    def shutdown(self) -> None:
        """Release the compiled graph and the workers (the placement group is its maker's to remove).
        The core's loop must have stopped stepping first (Coordinator.shutdown)."""
        if self.graph is not None:
            # A graph whose actor died may fail to tear down; the kills below still release everything.
            with contextlib.suppress(Exception):
                self.graph.teardown()
            self.graph = None
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self.rank0 is not None:
            with contextlib.suppress(Exception):  # a group whose peers are gone may not close cleanly
                self.rank0.close()
            self.rank0 = None
