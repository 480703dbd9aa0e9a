"""The MoE-parallelism benchmark runs both layouts over 2 Ray workers and writes its tables (figures are
not asserted; parity of the layouts is, in test_sharded.py)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import moe_parallel


@pytest.mark.slow
def test_bench_moe_prints_both_layouts(ray_cluster, tmp_path, capsys):
    assert moe_parallel.main(["--batch-sizes", "1,2", "--new-tokens", "4", "--repeats", "1",
                              "--run-dir", str(tmp_path)]) == 0
    assert "| 2 | tensor |" in capsys.readouterr().out
    results = json.loads((tmp_path / "bench" / "moe.json").read_text())
    assert all(r["same_tokens_as_tensor"] for r in results["end_to_end"])
    # tensor: every rank holds every expert's slice; expert: 8 experts, 4 whole ones per rank.
    assert [(r["mode"], len(r["rank_ms"])) for r in results["expert_times"]] == [
        ("tensor", 2), ("expert", 2), ("tensor", 2), ("expert", 2)]
