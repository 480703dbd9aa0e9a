"""The coordinator of one model replica, and its rank 0: it holds shard 0 itself (vLLM's and SGLang's
driver worker), places ranks 1..N-1 as worker actors, joins them in one collective group, and runs
the engine core (scheduler, KV blocks, sampling, verification, the EAGLE-3 draft) in a step loop of
its own. Rank 0's logits and hidden states never leave this process. The replica sends the requests
added and aborted whenever it has some, and reads the steps' new token ids from one long-lived
stream (core_messages.py; middle steps merged, run_core); it makes no call per step, and it
detokenizes and checks stop strings itself (output_processor.py): no text comes from here.

    replica (AsyncLLM / LLM)             coordinator = rank 0: run_core loop      ranks 1..N-1
    submit(CoreInput) ---fire&forget-->  inbox: aborts, then adds
                                         schedule; send the step ----------------> their shards
                                         rank 0's shard, in process <-collectives-> (no logits back)
                                         sample / verify_batch on rank 0's logits
                                         draft proposes the next k
    next reply  <------- stream -------  StepReply: token ids, finish reasons, logprobs

Plain class; `actors.CoordinatorActor` hosts it in a Ray actor (in bundle 0, with rank 0's GPU), the
loop in a thread of its own. It creates its workers itself, so a replica is one coordinator handle
however many GPUs it spans.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from warpspec.config.engine import EngineConfig
from warpspec.core.engine_core import LLMEngine
from warpspec.core.inbox import CoreInbox
from warpspec.core.messages import CoreInput, StepReply
from warpspec.errors import PlacementError, StepFailedError, WorkerDiedError
from warpspec.workers.comm import CollectiveError, CommInit, make_nccl_unique_id
from warpspec.workers.llama4 import check_parallel_layout
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.persistent_batch import BatchMirror
from warpspec.workers.runner import StepOutput
from warpspec.workers.step import StepPlan
from warpspec.workers.worker import ShardWorker, WorkerConfig, WorkerInfo, address_and_free_port


@dataclass
class ReplicaInfo:
    num_workers: int
    num_blocks: int
    workers: list[WorkerInfo]
    dispatch: str
    draft_aux_layer_ids: tuple[int, ...] | None = None  # when the coordinator runs an EAGLE-3 draft


SHUTDOWN_WAIT_S = 30.0  # for the core's step in progress
MAX_TIMINGS = 100_000  # steps of DispatchTiming kept while recording: ~10 MB at most


@dataclass
class DispatchTiming:
    wall_s: float  # coordinator: from sending the step to holding every worker's reply
    slowest_compute_s: float  # the longest any worker spent inside execute
    step_bytes: int = 0  # the step message sent to each of ranks 1..N-1
    reply_bytes: int = 0  # the largest reply of ranks 1..N-1 (rank 0's logits stay in this process)
    core_s: float = 0.0  # the whole core step around it: admitting, scheduling, dispatch, sampling, the draft


class Coordinator:
    def __init__(self, config: EngineConfig, placement_group: PlacementGroup, first_bundle: int = 0):
        """placement_group: one bundle per worker from first_bundle on (place_workers' own group, or
        the gang Serve placed the replica in: serving_bundles), made and removed by whoever holds this
        coordinator, so that it outlives a coordinator that dies."""
        from warpspec.executor.actors import ShardWorkerActor  # the actor shells import this module

        self.config = config
        self.parallel = config.parallel
        self.is_gpu = config.device.startswith("cuda")
        self.model_config = ModelConfig.from_pretrained(config.model)
        check_parallel_layout(self.model_config, self.parallel.num_workers, self.parallel.moe_parallel)
        self.placement_group, self.first_bundle = placement_group, first_bundle
        self.workers, self.graph, self.rank0 = [], None, None  # self.workers: ranks 1..N-1
        self.mirror = BatchMirror()  # what ranks 1..N-1 hold of the batch
        # Filled only while a benchmark asks (record_timings): a replica runs for months, one entry a step.
        self.timings: deque[DispatchTiming] | None = None
        self.is_broken = False
        self.inbox = CoreInbox()
        self.is_stepping = threading.Lock()  # held by run_core through each pass, so shutdown can wait it out
        try:
            num_workers = self.parallel.num_workers
            self.workers = [self._create_worker(ShardWorkerActor, rank) for rank in range(1, num_workers)]
            self.rank0, self.infos = self._start_shards()
            # One rank holds the whole embedding table, which the draft then shares (LLMEngine); over
            # more, rank 0 holds a vocabulary shard, and the draft reads the table from the checkpoint.
            self.runner = self.rank0.runner if num_workers == 1 else None
            self.num_blocks = min(i.num_blocks for i in self.infos)
            # The engine warms every rank up (warm_up) before the step graph exists: once compiled, the
            # Ray graph holds each worker's thread, and the workers take no other calls.
            self.engine = LLMEngine(config, executor=self)  # loads the draft too, when config names one
            use_graph = self.parallel.dispatch == "compiled" and self.workers
            self.graph = self._compile_step_graph() if use_graph else None
        except BaseException:
            self.shutdown()  # a half-built replica must not keep its actors
            raise

    # ---- setup ----------------------------------------------------------------------------------

    def _create_worker(self, actor_class, rank: int):
        strategy = PlacementGroupSchedulingStrategy(self.placement_group,
                                                    placement_group_bundle_index=self.first_bundle + rank)
        return actor_class.options(scheduling_strategy=strategy, **worker_resources(self.config, rank)).remote()

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
        from warpspec.workers.shm_comm import shared_memory_available

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
                                self.parallel.moe_parallel, self.config.deterministic, self.config.run_dir)
                   for rank in range(self.parallel.num_workers)]
        # Every rank must enter the group together: start the others, join here, then wait for them.
        started = [w.start.remote(c) for w, c in zip(self.workers, configs[1:], strict=True)]
        rank0 = ShardWorker(configs[0])
        return rank0, [rank0.info(), *unwrap_ray_errors(lambda: ray.get(started))]

    def _compile_step_graph(self):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step:
            graph = MultiOutputNode([w.execute.bind(step) for w in self.workers])
        return graph.experimental_compile()

    # ---- the step -------------------------------------------------------------------------------

    def info(self) -> ReplicaInfo:
        proposer = self.engine.proposer
        return ReplicaInfo(self.parallel.num_workers, self.num_blocks, self.infos, self.parallel.dispatch,
                           tuple(proposer.aux_layer_ids) if proposer is not None else None)

    def submit(self, message: CoreInput) -> None:
        """The replica's requests added and aborted; run_core applies them before its next step."""
        self.inbox.put(message)

    def run_core(self) -> Iterator[StepReply]:
        """The engine core's loop: apply the replica's messages, step while anything is unfinished,
        and reply (Ray streams the replies to the replica). Idle, it waits for a message. Ends when
        shutdown closes the inbox; a dead worker ends it with WorkerDiedError.

        A reply costs the core ~0.3 ms in Ray (ParallelConfig.core_reply_interval_ms), so steps that
        only add tokens to running requests are held and merged, up to the interval since the last
        reply. A reply goes at once when it is urgent (StepReply.is_urgent), when the replica's
        messages were applied (an abort's freed blocks show in its stats), or when nothing is left to
        run."""
        engine, interval_s = self.engine, self.parallel.core_reply_interval_ms / 1e3
        held, last_sent = None, time.monotonic()
        while True:
            messages = self.inbox.take(wait=held is None and not engine.has_unfinished())
            if messages is None:
                return
            with self.is_stepping:
                reply = self._pass(messages)
            if reply is None:
                continue
            held = reply if held is None else held.then(reply)
            if (messages or held.is_urgent or not engine.has_unfinished()
                    or time.monotonic() - last_sent >= interval_s):
                yield held
                held, last_sent = None, time.monotonic()

    def _pass(self, messages: list[CoreInput]) -> StepReply | None:
        """Apply messages, then one step if anything is unfinished. None when neither happened."""
        engine = self.engine
        start, last_timing = time.perf_counter(), self.timings[-1] if self.timings else None
        failures = [failure for message in messages for failure in self._apply(message)]
        deltas = []
        if engine.has_unfinished():
            try:
                deltas = engine.step()
            except StepFailedError as e:  # the engine dropped that step's requests and serves the rest
                failures.append(e)
        elif not messages:
            return None
        reply = StepReply(deltas, engine.stats(), engine.spec_stats,
                          failures, time.monotonic())
        if self.timings and self.timings[-1] is not last_timing:  # this pass ran a step on the workers
            self.timings[-1].core_s = time.perf_counter() - start
        return reply

    def _apply(self, message: CoreInput) -> list[StepFailedError]:
        for request_id in message.aborts:
            self.engine.abort(request_id)
        failures = []
        for request in message.adds:
            try:
                self.engine.add_request(request)
            except Exception as e:  # noqa: BLE001 - one request the core cannot take must not end the loop
                failures.append(StepFailedError.caused_by([request.request_id], e))
        return failures

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        """Every rank builds its compiled step graphs (ModelRunner.warm_up) at once: the warm-up steps
        meet in their collectives."""
        pending = [w.warm_up.remote(aux_layer_ids) for w in self.workers]
        self.rank0.warm_up(aux_layer_ids)
        unwrap_ray_errors(lambda: ray.get(pending))

    def execute(self, plan: StepPlan) -> StepOutput:
        """The engine's executor: one step on every rank. Ranks 1..N-1 get it as a delta against the
        batch they keep (persistent_batch.py); rank 0 runs it here, meeting them in the step's
        collectives, and its logits and hidden states stay."""
        if self.is_broken:
            raise WorkerDiedError("a worker of this replica died earlier; the replica must be rebuilt")
        step = plan.build()
        step_bytes = b""
        if self.workers:
            step_bytes = self.mirror.delta(plan.seqs, plan.block_size, plan.aux_layer_ids,
                                           plan.left_request_ids).to_bytes()
        start = time.perf_counter()
        try:
            output, replies = self._run_step(step, step_bytes)
        except BaseException:
            # Some rank may not have applied the delta: the next one sends the batch whole.
            self.mirror.needs_reset = True
            raise
        if self.timings is not None:
            slowest = max([output.compute_s, *(compute_s for compute_s, _ in replies)])
            self.timings.append(DispatchTiming(time.perf_counter() - start, slowest, len(step_bytes),
                                               max((len(r) for _, r in replies), default=0)))
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
        """End the core's loop (after the step it is in) and release the compiled graph and the workers
        (the placement group is its maker's to remove)."""
        self.inbox.close()
        # A step that never returns (a hung collective) must not keep the workers alive: kill them anyway.
        if self.is_stepping.acquire(timeout=SHUTDOWN_WAIT_S):
            self.is_stepping.release()
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


def worker_resources(config: EngineConfig, rank: int) -> dict[str, float]:
    """Ray options of rank's actor (rank 0: the coordinator): its bundle's GPU, or one CPU."""
    if not config.device.startswith("cuda"):
        return {"num_cpus": 1}
    return {"num_gpus": 1, "num_cpus": 0}


def coordinator_options(config: EngineConfig, group: PlacementGroup, first_bundle: int = 0) -> dict:
    """Ray options of the coordinator actor: rank 0's, in rank 0's bundle, whose GPU also runs the draft."""
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first_bundle)
    return {**worker_resources(config, 0), "scheduling_strategy": strategy}


def _bundle(config: EngineConfig) -> dict[str, float]:
    return {"GPU": 1} if config.device.startswith("cuda") else {"CPU": 1}


def serving_bundles(config: EngineConfig, num_cpus: float, num_gpus: float) -> list[dict[str, float]]:
    """The gang a served replica is placed as (Serve's placement_group_bundles, STRICT_PACK): bundle 0
    is the replica actor's own, bundles 1..N its ranks'. One node holds them all: a replica never
    straddles two nodes (NVLink does not cross them)."""
    replica = {name: amount for name, amount in (("CPU", num_cpus), ("GPU", num_gpus)) if amount}
    return [replica or {"CPU": 0.0}] + [_bundle(config) for _ in range(config.parallel.num_workers)]


def replica_gang(config: EngineConfig) -> PlacementGroup | None:
    """The placement group Serve placed this replica in with its ranks (serving_bundles), or None
    outside one (LLM and AsyncLLM in a driver place their own workers)."""
    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) != config.parallel.num_workers + 1:
        return None
    return group


def check_gang_fits(bundles: list[dict[str, float]], timeout_s: float) -> None:
    """Reserve bundles as one STRICT_PACK group and release them: raises PlacementError naming every
    node's resources when no node could take them within timeout_s. An autoscaling cluster sees the
    waiting group as demand and may add a node meanwhile; without one, a gang no node can hold would
    leave a served replica pending forever."""
    group = placement_group(bundles, strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        state = placement_group_table(group).get("stats", {}).get("scheduling_state", "")
        reason = "no node is large enough" if state == "INFEASIBLE" else "the nodes large enough are busy"
        raise PlacementError(f"a replica needs {_compute(_sum(bundles))} on one node (its actor and its "
                             f"workers, STRICT_PACK), and {reason} after {timeout_s:g} s (placement_timeout_s); "
                             f"nodes: {_nodes()}") from None
    finally:
        remove_placement_group(group)


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0) + amount
    return total


def _compute(resources: dict[str, float]) -> str:
    """{'CPU': 3.0, 'memory': ...} -> 'CPU 3, GPU 0'"""
    return ", ".join(f"{name} {resources.get(name, 0):g}" for name in ("CPU", "GPU"))


def _nodes() -> str:
    """Every live node's total CPUs and GPUs: '10.0.0.5 (node 1a2b3c4d): CPU 2, GPU 0; ...'"""
    return "; ".join(f"{n['NodeManagerAddress']} (node {n['NodeID'][:8]}): {_compute(n['Resources'])}"
                     for n in ray.nodes() if n["Alive"])


def place_workers(config: EngineConfig) -> PlacementGroup:
    """One bundle per worker. Fails at once, before any weight is read, when the cluster can never
    hold the workers, and after placement_timeout_s when it cannot now.

    Call it in the process that holds the coordinator: Ray ties a placement group to the job that made
    it, or to the detached actor (a Serve replica) that made it, never to an ordinary actor. Made by the
    coordinator, a group would outlive a coordinator that died."""
    parallel = config.parallel
    resource, per_worker = next(iter(_bundle(config).items()))
    available = ray.cluster_resources().get(resource, 0)
    needed = per_worker * parallel.num_workers
    if available < needed:
        raise PlacementError(f"num_workers={parallel.num_workers} needs {needed:g} {resource} "
                             f"(one per worker) but the Ray cluster has {available:g}")
    bundles = [_bundle(config) for _ in range(parallel.num_workers)]
    group = placement_group(bundles, strategy=parallel.placement_strategy)
    try:
        ray.get(group.ready(), timeout=parallel.placement_timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"could not place {len(bundles)} workers ({bundles[0]} each, {parallel.placement_strategy}) "
            f"within {parallel.placement_timeout_s:g} s; free resources: {ray.available_resources()}"
        ) from None
    return group


def unwrap_ray_errors(call):
    """Run call; re-raise the user-facing error a remote task raised (CheckpointError, ValueError, ...)
    instead of Ray's wrapper around it."""
    try:
        return call()
    except RayTaskError as e:
        if e.cause is not None and not isinstance(e.cause, RayActorError):
            raise e.cause from None
        raise
