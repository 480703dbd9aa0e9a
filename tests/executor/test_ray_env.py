"""With RAY_ADDRESS set, warpspec joins that cluster instead of starting its own; the private Ray APIs
that ray_env.py fences still do what it relies on (an upgrade that changes one fails here, by name)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HOLD_CLUSTER = textwrap.dedent("""
    import sys, ray
    from warpspec.executor.ray_env import start_local_ray
    start_local_ray(sys.argv[1], num_cpus=4)
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # hold the cluster until the test closes our stdin
""")

JOIN_AND_GENERATE = textwrap.dedent("""
    import sys, ray
    from warpspec import LLM, SamplingParams
    from warpspec.training.random_checkpoint import create_random_checkpoint
    path = create_random_checkpoint(sys.argv[1], "tiny")
    with LLM(str(path), num_workers=2) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        print(ray.get_runtime_context().gcs_address, len(out.token_ids), flush=True)
""")


@pytest.mark.slow
@pytest.mark.ray  # a cluster of its own, in a holder process
def test_llm_joins_the_cluster_named_by_ray_address(tmp_path, short_tmp_dir):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CLUSTER, short_tmp_dir], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = holder.stdout.readline().strip()
        assert address, "the holding process did not start a cluster"
        result = subprocess.run([sys.executable, "-c", JOIN_AND_GENERATE, str(tmp_path / "ckpt")],
                                capture_output=True, text=True, timeout=180, env={**env, "RAY_ADDRESS": address})
        assert result.returncode == 0, result.stderr[-2000:]
        joined, generated = result.stdout.strip().splitlines()[-1].split()
        assert joined == address and generated == "4"
    finally:
        holder.stdin.close()  # the holder exits, and its cluster with it
        holder.wait(timeout=60)


def test_start_local_ray_keeps_the_sessions_files_in_the_folder_it_is_given(ray_cluster):
    """ray.init(_temp_dir=...): the shared cluster was started by start_local_ray (helpers/ray_cluster.py)."""
    from helpers.ray_cluster import SESSION_FOLDER
    from warpspec.executor import ray_env

    latest = SESSION_FOLDER[-1] / "session_latest"
    assert latest.is_dir() and any(latest.iterdir()), \
        f"no session files in {latest}: ray.init ignored _temp_dir (checked against ray {ray_env.RAY_CHECKED})"


def test_live_actors_lists_a_live_actor_with_its_class_and_node_until_it_dies(ray_cluster):
    from helpers.waiting import wait_for
    from warpspec.executor.ray_env import live_actors

    @ray_cluster.remote(num_cpus=0)
    class Probe:
        def node(self) -> str:
            return ray_cluster.get_runtime_context().get_node_id()

    probe = Probe.remote()
    node = ray_cluster.get(probe.node.remote())
    mine = [a for a in live_actors() if a["ActorClassName"].split(":")[0].endswith("Probe")]
    assert [a["Address"]["NodeID"] for a in mine] == [node]
    ray_cluster.kill(probe)
    wait_for(lambda: not any(a["ActorClassName"].endswith("Probe") for a in live_actors()), 30, "the probe's end")
