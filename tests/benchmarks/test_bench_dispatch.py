"""The dispatch benchmark runs end to end and writes its table (figures are not asserted, only that
each was measured and that what crosses to the replica is small)."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import dispatch


@pytest.mark.slow
def test_bench_dispatch_prints_every_mode(ray_cluster, tmp_path, capsys):
    assert dispatch.main(["--batch", "2", "--new-tokens", "6", "--run-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| tiny | compiled | 2 |" in printed and "| tiny | actor | 2 |" in printed
    assert "| bundled + EAGLE-3 | compiled | 2 |" in printed
    rows = json.loads((tmp_path / "bench" / "dispatch.json").read_text())["rows"]
    assert [r["dispatch"] for r in rows] == ["compiled", "actor", "compiled"]
    assert all(r["slowest_compute_ms_p50"] > 0 and r["host_overhead_ms_p50"] > 0 for r in rows)
    assert rows[0]["steps"] == rows[1]["steps"] == 5  # 6 tokens: prefill + 5 decode steps, without a draft
    assert 1 <= rows[2]["steps"] <= 5  # with the draft, fewer target steps
    # The EAGLE-3 replica chooses its draft length from its step costs, timed at start-up on its two
    # workers for every batch size up to 64 and both lengths, and printed.
    assert "The step cost model of bundled + EAGLE-3" in printed and not rows[0]["step_costs"]
    timed = {(step, num_seqs, length) for step, num_seqs, length, ms in rows[2]["step_costs"] if ms > 0}
    assert {("target", n, q) for n in (1, 2, 4, 8, 16, 32, 64) for q in (1, 4)} <= timed
    assert {("draft", n, k) for n in (1, 2, 4, 8, 16, 32, 64) for k in (0, 3)} <= timed
    tiny = rows[0]
    # The replica sends its batch once and then only reads the core's stream: no message per step.
    assert tiny["replica_to_core_messages"] == 1 and tiny["stream_lag_ms_p50"] >= 0
    # Logits (2 x 512 float32 = 4 KB) stay in rank 0, the coordinator: rank 1 replies with its compute
    # time only, and the replica gets token ids.
    assert tiny["rank1_to_core_bytes_p50"] < 200 and tiny["core_to_replica_bytes_p50"] < 2 * 512 * 4 / 2
