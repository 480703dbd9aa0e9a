"""`warpspec bench restart` refuses what it cannot measure before it launches anything. Its figures
(launch to SERVING, first against tenth TTFT, rebuilds after SIGKILL) are in benchmarks/results; the
rebuild itself is asserted in tests/serving/test_faults.py."""

import pytest

from warpspec.benchmarks import restart


def test_an_unknown_victim_is_refused_naming_the_choices():
    with pytest.raises(SystemExit, match="--kills: each one of worker, coordinator, got 'raylet'"):
        restart.main(["--kills", "worker,raylet"])


def test_kills_need_a_worker_beside_the_coordinator():
    with pytest.raises(SystemExit, match="--kills needs --workers 2 or more"):
        restart.main(["--workers", "1"])
