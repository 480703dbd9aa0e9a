"""The dispatch benchmark runs end to end and writes its table (figures are not asserted)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import dispatch


@pytest.mark.slow
def test_bench_dispatch_prints_both_modes(ray_cluster, tmp_path, capsys):
    assert dispatch.main(["--batch", "2", "--new-tokens", "6", "--run-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| compiled | 2 |" in printed and "| actor | 2 |" in printed
    rows = json.loads((tmp_path / "bench" / "dispatch.json").read_text())["rows"]
    assert [r["dispatch"] for r in rows] == ["compiled", "actor"]
    assert all(r["steps"] == 5 and r["slowest_compute_ms_p50"] > 0 for r in rows)
