"""`warpspec bench weights` writes a sharded checkpoint, loads it beside a sequential read and writes
its table; the loaded model holds the checkpoint's values (figures are not asserted)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from warpspec.benchmarks import weights
from warpspec.workers.loader import load_model


def test_bench_weights_compares_the_load_with_a_sequential_read(tmp_path, capsys):
    assert weights.main(["--gigabytes", "0.3", "--shard-gb", "0.1", "--repeats", "1", "--run-dir", str(tmp_path)]) == 0
    assert "| warpspec load |" in capsys.readouterr().out
    report = json.loads((tmp_path / "bench" / "weights.json").read_text())
    assert [r["what"] for r in report["rows"]] == ["sequential read", "warpspec load"] and report["files"] >= 3
    # Every byte of a one-rank load is read once: as many as the files hold, less their headers.
    assert 0.99 < report["rows"][1]["gb"] / report["rows"][0]["gb"] <= 1
    folder = tmp_path / "bench" / "weights-0.3gb"
    model = load_model(folder, dtype="bfloat16")
    stored = {}
    for path in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(path))
    experts = model.model.layers[1].feed_forward.experts
    assert torch.equal(experts.gate_up_proj, stored["model.layers.1.feed_forward.experts.gate_up_proj"])


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit, match="--gigabytes and --shard-gb: positive sizes"):
        weights.main(["--gigabytes", "0"])
