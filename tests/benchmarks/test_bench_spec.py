"""The speculative decoding benchmark runs and writes its table (figures are not asserted)."""

from __future__ import annotations

import json

import pytest

from helpers.eagle3_checkpoints import make_eagle3_checkpoint
from warpspec.benchmarks import spec
from warpspec.training.random_checkpoint import create_random_checkpoint


@pytest.mark.slow
def test_bench_spec_prints_the_speedup_table(tmp_path, capsys):
    target = create_random_checkpoint(tmp_path / "target", "tiny")
    draft = make_eagle3_checkpoint(tmp_path / "draft", hidden=64, vocab=512, draft_vocab=100, heads=4, kv_heads=1)
    assert spec.main(["--target", str(target), "--draft", str(draft), "--batch-sizes", "1,2", "--new-tokens", "6",
                      "--repeats", "1", "--run-dir", str(tmp_path)]) == 0
    assert "| 1 |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "bench" / "spec.json").read_text())
    assert [r["batch"] for r in rows] == [1, 2] and all(r["same_tokens"] for r in rows)
