"""Where a replica's ranks go on a Ray cluster: one bundle per rank (a GPU each, or a CPU), placed by
LLM and AsyncLLM themselves (place_workers), or by Serve as the replica's gang (serving_bundles), and
the Ray options each rank's actor takes inside its bundle."""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from warpspec.config.engine import EngineConfig
from warpspec.errors import PlacementError


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


