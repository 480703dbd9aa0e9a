"""The seeded-speculation benchmark runs its four sections on the bundled pair and writes its tables
(figures are not asserted; the tokens it compares are, in test_seeded_speculation.py)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import seeds


@pytest.mark.slow
def test_bench_seeds_prints_its_tables(tmp_path, capsys):
    # The fixed policy: the adaptive one times its steps at each of the 9 starts with the draft (two thirds of
    # this test's 35 s), and its timing has tests of its own (tests/spec_decode).
    assert seeds.main(["--crowd-requests", "4", "--spread-s", "0.2", "--prefix-requests", "2", "--batch", "2",
                       "--temperatures", "1.0", "--cost-batch-sizes", "1,2", "--new-tokens", "6", "--repeats", "1",
                       "--speculative-policy", "fixed", "--no-compile-draft", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "k=3 (fixed)" in out
    assert "| coupled | alone, no draft | 0/4 |" in out and "| 1.0 | 2 |" in out
    results = json.loads((tmp_path / "bench" / "seeds.json").read_text())
    assert [r["mode"] for r in results["crowd"]] == ["none", "rejection", "coupled", "deterministic"]
    assert [(r["batch"], r["temperature"]) for r in results["cost"]] == [(1, 0.8), (2, 0.8)]
    assert "| 2 | 0.8 |" in out
    assert [(r["temperature"], r["prefix_caching"]) for r in results["prefix"]] == [
        (0.0, False), (0.0, True), (0.7, False), (0.7, True)]
    assert all(r["same_tokens_as_without_caching"] for r in results["prefix"])
    assert results["coupling"][0]["coupled_same_tokens_as_plain"]
