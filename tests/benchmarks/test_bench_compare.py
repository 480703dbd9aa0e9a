"""The headline comparison runs on the bundled pair (eager), and compiled beside eager on another pair
with its own prompts and engine options, and writes its table and plot; every system, transformers'
included, emits the same greedy tokens (figures are not asserted). Bad prompts files and engine
options are refused before anything starts."""

from __future__ import annotations

import json

import pytest

from helpers.eagle3_checkpoints import make_speculation_draft, make_speculation_target
from warpspec.benchmarks import compare


@pytest.mark.slow
def test_bench_compare_prints_the_table_with_identical_tokens(tmp_path, capsys, ray_cluster):
    # Eager: compiling two ranks' steps and the draft's took 5 of CI's minutes, and the compiled
    # steps over two workers have their own test (tests/executor/test_sharded.py).
    # Both draft length policies, and a batch past the 16 held-out prompts (they repeat).
    # EAGLE-3 alone: a fourth engine of 2 workers finds no room in the session's 8-CPU cluster.
    assert compare.main(["--batch-sizes", "1,17", "--workers", "2", "--new-tokens", "6", "--repeats", "1",
                         "--enforce-eager", "--speculative-policies", "fixed,adaptive", "--methods", "eagle3",
                         "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| transformers greedy |" in out
    assert "| workers | batch 1: adaptive vs the better | batch 17: adaptive vs the better |" in out
    rows = json.loads((tmp_path / "bench" / "compare.json").read_text())
    assert {r["system"] for r in rows} == {compare.HF_GREEDY, compare.HF_LOOKUP, "warpspec eager",
                                           "warpspec eager + EAGLE-3 (fixed)", "warpspec eager + EAGLE-3 (adaptive)"}
    assert all(r["same_tokens"] for r in rows)
    assert (tmp_path / "bench" / "compare.png").stat().st_size > 0


def test_prompt_lookup_runs_beside_transformers_prompt_lookup(tmp_path, capsys):
    """warpspec's own prompt lookup drafts (speculative_method="ngram") beside transformers', in this
    process and eager: the same tokens, and an acceptance length for its row."""
    # 48 tokens: the bundled target's greedy text repeats itself within them, so lookups draft.
    assert compare.main(["--batch-sizes", "1", "--workers", "1", "--new-tokens", "48", "--repeats", "1",
                         "--batch1-prompts", "1", "--enforce-eager", "--methods", "ngram",
                         "--run-dir", str(tmp_path)]) == 0
    rows = {r["system"]: r for r in json.loads((tmp_path / "bench" / "compare.json").read_text())}
    assert set(rows) == {compare.HF_GREEDY, compare.HF_LOOKUP, "warpspec eager", "warpspec eager + prompt lookup (k=3)"}
    assert all(r["same_tokens"] for r in rows.values())
    assert rows["warpspec eager + prompt lookup (k=3)"]["acceptance_length"]["1"] > 1


@pytest.mark.slow
def test_one_worker_runs_compiled_and_eager_side_by_side(tmp_path, capsys):
    """On the speculative-decoding tests' pair at their block size (4): its compiled engine is then
    built from the target's and the draft's steps those tests saved (tests/spec_decode), not compiled
    again; the bundled pair's steps would be compiled here alone (344 s of CI's run), as would a prompt
    lookup engine's (its target steps capture no hidden states: 234 s here), so it runs EAGLE-3 alone."""
    target, draft = make_speculation_target(tmp_path / "target"), make_speculation_draft(tmp_path / "draft")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompt_token_ids": [list(range(3 + i, 23 + i)) for i in range(2)]}))
    assert compare.main(["--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--block-size", "4",
                         "--batch-sizes", "1", "--workers", "1", "--new-tokens", "6", "--repeats", "1",
                         "--batch1-prompts", "2", "--methods", "eagle3", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "OMP_WAIT_POLICY=" in out and "'draft (4, True)'" in out  # the draft's graphs report their threads
    assert "engine options {'block_size': 4}" in out
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
    with pytest.raises(SystemExit, match="--batch1-prompts: between 1 and 16 \\(the prompts in .*held_out_prompts"):
        compare.main(["--batch1-prompts", value])


@pytest.mark.parametrize(("content", "message"), [
    ("[1, 2]", "--prompts: .* is no JSON object with a prompt_token_ids list"),
    ('{"prompt_token_ids": [[1, 2], []]}', "--prompts: prompt_token_ids in .* must be a non-empty list of non-empty"),
    ('{"prompt_token_ids": [[1, 2], [1, 2, 3]]}', "--prompts: every prompt must have the same length .* got lengths "
                                                  "\\[2, 3\\]"),
    ('{"prompt_token_ids": [[1, 2], [8191, 8192]]}', "--prompts: prompt 1 holds token id 8192, outside the target's "
                                                     "vocabulary \\(vocab_size 8192\\)"),
])
def test_prompts_the_comparison_cannot_run_are_refused(tmp_path, content, message):
    path = tmp_path / "prompts.json"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        compare.main(["--prompts", str(path)])


def test_an_engine_option_of_the_wrong_kind_is_refused_naming_it():
    with pytest.raises(SystemExit, match="block_size must be int, got 'four'"):
        compare.main(["--block-size", "four"])


def test_an_unknown_drafter_is_refused():
    with pytest.raises(SystemExit, match="--methods: a list of eagle3, ngram, got 'eagle3,medusa'"):
        compare.main(["--methods", "eagle3,medusa"])


def test_an_unknown_draft_length_policy_is_refused():
    with pytest.raises(SystemExit, match="--speculative-policies: a list of adaptive, fixed, got 'fixed,greedy'"):
        compare.main(["--speculative-policies", "fixed,greedy"])
