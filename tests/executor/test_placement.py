"""Where a replica's actors go on GPU nodes: one GPU per rank, and the coordinator is rank 0, in bundle
0 with its GPU, where the draft runs too (the GPU run itself needs a GPU cluster; these are the Ray
options)."""

from __future__ import annotations

from ray.util.placement_group import PlacementGroup

from warpspec.config.options import engine_config
from warpspec.executor.placement import coordinator_options, worker_resources


def test_on_gpus_the_coordinator_takes_bundle_0s_whole_gpu_draft_or_not():
    for draft in ("draft", None):
        config = engine_config("ckpt", device="cuda", draft=draft, num_workers=4)
        options = coordinator_options(config, PlacementGroup.empty())
        assert options["num_gpus"] == 1 and options["num_cpus"] == 0
        assert options["scheduling_strategy"].placement_group_bundle_index == 0
        # The coordinator places ranks 1..3 in bundles 1..3, a GPU each.
        assert [worker_resources(config, rank) for rank in range(1, 4)] == [{"num_gpus": 1, "num_cpus": 0}] * 3


def test_on_cpus_the_coordinator_takes_bundle_0s_cpu():
    config = engine_config("ckpt", draft="draft", num_workers=2)
    options = coordinator_options(config, PlacementGroup.empty())
    assert options["num_cpus"] == 1 and "num_gpus" not in options
    assert options["scheduling_strategy"].placement_group_bundle_index == 0
    assert worker_resources(config, 1) == {"num_cpus": 1}
