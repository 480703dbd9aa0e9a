"""`warpspec bench kv_cache` on a small scale: Llama 4's memory figures, the running engine's blocks
against the formula, capacity in one budget, step times and prefix hits with the two caches (the
figures of speed are not asserted)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import kv_cache


def test_bench_kv_cache_compares_the_hybrid_cache_with_the_full_one(tmp_path, capsys):
    argv = ["--run-dir", str(tmp_path), "--chunk-size", "32", "--chunks", "3", "--seq-tokens", "128",
            "--budget-kib", "1024", "--repeats", "1", "--batches", "2", "--enforce-eager"]
    assert kv_cache.main(argv) == 0
    assert "| Maverick | 128k |" in capsys.readouterr().out
    report = json.loads((tmp_path / "bench" / "kv_cache.json").read_text())
    ratios = {(r["model"], r["context"]): r["ratio"] for r in report["memory"]}
    # (12 x 128k + 36 x 8k) / (48 x 128k), and 1.0 within the first chunk.
    assert ratios["Maverick", "128k"] == pytest.approx(0.297, abs=1e-3) and ratios["Scout", "8k"] == 1.0
    assert report["held"]["measured_bytes"] == report["held"]["formula_bytes"]
    hybrid, full = report["capacity"]
    assert hybrid["hybrid"] and not full["hybrid"]
    # One budget: the hybrid cache reaches a longer context and runs more sequences at once.
    assert hybrid["longest_context"] > full["longest_context"]
    assert hybrid["concurrent_seqs"] > full["concurrent_seqs"]
    assert all(row["same_tokens"] for row in report["steps"] + report["prefix"])
    hybrid_prefix, full_prefix = report["prefix"]
    assert hybrid_prefix["hit_tokens"] == full_prefix["hit_tokens"] > 0
    assert hybrid_prefix["acceptance_length"] == full_prefix["acceptance_length"] > 1


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        kv_cache.main(["--chunk-size", "8"])
