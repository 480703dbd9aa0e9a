"""The throughput benchmark runs end to end beside transformers and writes table, JSON and plot
(figures are not asserted: this machine is noisy)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import throughput
from warpspec.training.random_checkpoint import create_random_checkpoint


@pytest.mark.slow
def test_bench_throughput_writes_its_side_by_side_table(tmp_path, capsys):
    model = create_random_checkpoint(tmp_path / "model", "tiny")
    status = throughput.main(["--model", str(model), "--concurrency", "1,3", "--new-tokens", "5",
                              "--prompt-len", "8", "--repeats", "1", "--run-dir", str(tmp_path)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "| 3 |" in printed
    rows = json.loads((tmp_path / "bench" / "throughput.json").read_text())
    assert [r["concurrency"] for r in rows] == [1, 3]
    # Greedy decoding of the same checkpoint: both engines must produce the same tokens.
    assert all(r["same_tokens"] for r in rows)
    assert (tmp_path / "bench" / "throughput.png").stat().st_size > 0
