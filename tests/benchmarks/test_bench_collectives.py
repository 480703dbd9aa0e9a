"""`warpspec bench collectives` runs both backends between real rank processes and reports each."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import collectives
from warpspec.workers.distributed.shm_comm import shared_memory_available


@pytest.mark.skipif(not shared_memory_available(), reason="needs an x86-64 host with /dev/shm")
def test_both_backends_are_timed_for_every_row_count(tmp_path, capsys):
    assert collectives.main(["--rows", "1,3", "--calls", "50", "--run-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench" / "collectives.json").read_text())
    timings = report["seconds_per_all_reduce"]
    assert sorted(timings) == ["gloo", "shm"]
    for backend in timings.values():
        assert sorted(backend) == ["1", "3"]  # JSON keys: the row counts
        assert all(0 < seconds < 1 for seconds in backend.values())
    assert "| 3 |" in capsys.readouterr().out
