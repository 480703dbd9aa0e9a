"""With RAY_ADDRESS set, warpspec joins that cluster instead of starting its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HOLD_CLUSTER = textwrap.dedent("""
    import sys, ray
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=sys.argv[1], log_to_driver=False)
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
def test_llm_joins_the_cluster_named_by_ray_address(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    temp_dir = tmp_path / "r"
    if len(str(temp_dir)) > 50:  # unix socket paths under it must stay short
        import tempfile

        temp_dir = tempfile.mkdtemp(prefix="ws-ray-addr-")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CLUSTER, str(temp_dir)], stdin=subprocess.PIPE,
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
