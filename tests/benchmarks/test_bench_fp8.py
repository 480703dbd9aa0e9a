"""`warpspec bench fp8` runs on the bundled pair and writes its side-by-side table."""

from __future__ import annotations

import json

from warpspec.cli.main import main


def test_bench_fp8_reports_both_precisions(tmp_path, capsys):
    assert main(["bench", "fp8", "--windows", "2", "--new-tokens", "4", "--run-dir", str(tmp_path)]) == 0
    assert "| FP8 e4m3, per-channel |" in capsys.readouterr().out
    report = json.loads((tmp_path / "bench" / "fp8_quality.json").read_text())
    baseline, fp8 = report["rows"]
    assert (baseline["quantization"], fp8["quantization"]) == ("none", "fp8")
    assert fp8["fp8_modules"] > 0 and baseline["fp8_modules"] == 0
    assert fp8["param_bytes"] < 0.7 * baseline["param_bytes"]  # bf16 -> FP8 for most weights
    assert baseline["same_tokens"] == 1.0
    # A tiny model barely trained: FP8 must not wreck it (measured: 48.06 vs 48.15 on 4 windows).
    assert fp8["perplexity"] < 1.1 * baseline["perplexity"]
    assert (tmp_path / "bench" / "fp8_quality.md").read_text().startswith("| target weights |")
