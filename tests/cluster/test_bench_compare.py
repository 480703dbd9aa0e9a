"""The headline comparison runs on the bundled pair and writes its table and plot; every system,
transformers' included, emits the same greedy tokens (figures are not asserted)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import compare


@pytest.mark.slow
def test_bench_compare_prints_the_table_with_identical_tokens(tmp_path, capsys, ray_cluster):
    assert compare.main(["--batch-sizes", "1,2", "--workers", "2", "--new-tokens", "6", "--repeats", "1",
                         "--run-dir", str(tmp_path)]) == 0
    assert "| transformers greedy |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "bench" / "compare.json").read_text())
    assert {r["system"] for r in rows} == {compare.HF_GREEDY, compare.HF_LOOKUP, "warpspec",
                                           "warpspec + EAGLE-3 (k=3)"}
    assert all(r["same_tokens"] for r in rows)
    assert (tmp_path / "bench" / "compare.png").stat().st_size > 0


@pytest.mark.slow
def test_one_worker_runs_compiled_and_eager_side_by_side(tmp_path):
    assert compare.main(["--batch-sizes", "1", "--workers", "1", "--new-tokens", "6", "--repeats", "1",
                         "--run-dir", str(tmp_path)]) == 0
    rows = {r["system"]: r for r in json.loads((tmp_path / "bench" / "compare.json").read_text())}
    assert set(rows) == {compare.HF_GREEDY, compare.HF_LOOKUP, "warpspec", "warpspec + EAGLE-3 (k=3)",
                         "warpspec eager", "warpspec eager + EAGLE-3 (k=3)"}
    assert all(r["same_tokens"] for r in rows.values())
    for name in ("warpspec + EAGLE-3 (k=3)", "warpspec eager + EAGLE-3 (k=3)"):
        assert 0 < rows[name]["draft_share"]["1"] < 1
