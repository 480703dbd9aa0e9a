"""Where a replica's actors go on GPU nodes: one GPU per worker, and with a draft the coordinator
shares GPU 0 with rank 0 (the GPU run itself needs a GPU cluster; these are the Ray options)."""

from __future__ import annotations

from ray.util.placement_group import PlacementGroup

from warpspec.config import engine_config
from warpspec.coordinator import DRAFT_GPU_SHARE, coordinator_options, worker_resources


def test_gpu_replica_with_a_draft_shares_gpu_0_between_rank_0_and_the_coordinator():
    config = engine_config("ckpt", device="cuda", draft="draft", num_workers=4)
    options = coordinator_options(config, PlacementGroup.empty())
    assert options["num_gpus"] == DRAFT_GPU_SHARE and options["num_cpus"] == 0
    assert options["scheduling_strategy"].placement_group_bundle_index == 0
    shares = [worker_resources(config, rank)["num_gpus"] for rank in range(4)]
    assert shares == [1 - DRAFT_GPU_SHARE, 1, 1, 1]
    # Bundle 0 holds exactly one GPU: rank 0 plus the coordinator.
    assert shares[0] + options["num_gpus"] == 1


def test_without_a_draft_or_a_gpu_the_coordinator_takes_nothing():
    plain_gpu = engine_config("ckpt", device="cuda", num_workers=2)
    assert coordinator_options(plain_gpu, PlacementGroup.empty()) == {"num_cpus": 0}
    assert worker_resources(plain_gpu, 0) == {"num_gpus": 1, "num_cpus": 0}
    cpu_with_draft = engine_config("ckpt", draft="draft", num_workers=2)
    assert coordinator_options(cpu_with_draft, PlacementGroup.empty()) == {"num_cpus": 0}
    assert worker_resources(cpu_with_draft, 0) == {"num_cpus": 1}
