"""The headline comparison runs on the bundled pair and writes its table and plot; every system,
transformers' included, emits the same greedy tokens (figures are not asserted)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import compare


@pytest.mark.slow
def test_bench_compare_prints_the_table_with_identical_tokens(tmp_path, capsys, ray_cluster):
    # Eager: compiling two ranks' steps and the draft's took 5 of CI's minutes, and the compiled
    # steps over two workers have their own test (tests/executor/test_sharded.py).
    # Both draft length policies, and a batch past the 16 held-out prompts (they repeat).
    assert compare.main(["--batch-sizes", "1,17", "--workers", "2", "--new-tokens", "6", "--repeats", "1",
                         "--enforce-eager", "--speculative-policies", "fixed,adaptive",
                         "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| transformers greedy |" in out
    assert "| workers | batch 1: adaptive vs the better | batch 17: adaptive vs the better |" in out
    rows = json.loads((tmp_path / "bench" / "compare.json").read_text())
    assert {r["system"] for r in rows} == {compare.HF_GREEDY, compare.HF_LOOKUP, "warpspec eager",
                                           "warpspec eager + EAGLE-3 (fixed)", "warpspec eager + EAGLE-3 (adaptive)"}
    assert all(r["same_tokens"] for r in rows)
    assert (tmp_path / "bench" / "compare.png").stat().st_size > 0


@pytest.mark.slow
def test_one_worker_runs_compiled_and_eager_side_by_side(tmp_path, capsys):
    assert compare.main(["--batch-sizes", "1", "--workers", "1", "--new-tokens", "6", "--repeats", "1",
                         "--batch1-prompts", "2", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "OMP_WAIT_POLICY=" in out and "'draft (4, True)'" in out  # the draft's graphs report their threads
    rows = {r["system"]: r for r in json.loads((tmp_path / "bench" / "compare.json").read_text())}
    # Batch 1 is the median over 2 prompts, each run alone.
    assert all(len(r["per_prompt_batch1"]) == 2 for r in rows.values())
    assert set(rows) == {compare.HF_GREEDY, compare.HF_LOOKUP, "warpspec", "warpspec + EAGLE-3 (k=3)",
                         "warpspec eager", "warpspec eager + EAGLE-3 (k=3)"}
    assert all(r["same_tokens"] for r in rows.values())
    for name in ("warpspec + EAGLE-3 (k=3)", "warpspec eager + EAGLE-3 (k=3)"):
        assert 0 < rows[name]["draft_share"]["1"] < 1


@pytest.mark.parametrize("value", ["0", "17"])
def test_batch1_prompts_out_of_range_is_refused(value):
    with pytest.raises(SystemExit, match="--batch1-prompts: between 1 and 16"):
        compare.main(["--batch1-prompts", value])


def test_an_unknown_draft_length_policy_is_refused():
    with pytest.raises(SystemExit, match="--speculative-policies: a list of adaptive, fixed, got 'fixed,greedy'"):
        compare.main(["--speculative-policies", "fixed,greedy"])
