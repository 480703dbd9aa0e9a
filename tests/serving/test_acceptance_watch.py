"""AcceptanceWatch (serving/metrics.py): the last minute's acceptance length from a replica's
cumulative per-position counts, and when it counts as low; and the replica snapshot it reads."""

from __future__ import annotations

import dataclasses

import pytest

from warpspec.core.engine_stats import EngineStats
from warpspec.serving.metrics import AcceptanceWatch, ReplicaStats


def test_the_window_counts_only_its_own_verifications():
    watch = AcceptanceWatch(min_acceptance_length=1.3, window_s=60, min_verify_steps=10)
    # t 0: nothing yet. t 30: 100 verifications, 200 drafts accepted (first 100 at position 1, 70 at
    # 2, 30 at 3): (200 + 100) / 100 = 3.0.
    assert watch.update(0, (), ()) is None
    assert watch.update(30, (100, 100, 100), (100, 70, 30)) == 3.0
    # t 90: 100 more verifications accepting nothing. The window (t 30 .. 90) holds only those:
    # (0 + 100) / 100 = 1.0, low; over all time it would read 2.0.
    recent = watch.update(90, (200, 200, 200), (100, 70, 30))
    assert recent == 1.0 and watch.is_low(recent)
    # t 200: 100 more accepting everything; the window's baseline is t 90: (300 + 100) / 100 = 4.0.
    assert watch.update(200, (300, 300, 300), (200, 170, 130)) == 4.0


def test_too_few_verifications_or_no_minimum_judge_nothing():
    watch = AcceptanceWatch(min_acceptance_length=1.3, min_verify_steps=64)
    watch.update(0, (0,), (0,))
    assert watch.update(1, (10,), (0,)) is None and not watch.is_low(None)  # 10 of the 64 needed
    off = AcceptanceWatch(min_acceptance_length=0.0, min_verify_steps=1)
    off.update(0, (0,), (0,))
    assert not off.is_low(off.update(1, (10,), (0,)))  # 1.0, but 0 turns the warning off


@pytest.mark.parametrize("value", [0.5, -1.0])
def test_a_minimum_below_one_is_refused(value):
    from warpspec.serving.serve_config import ServeConfig

    with pytest.raises(ValueError, match="min_acceptance_length must be 0 .no warning. or >= 1"):
        ServeConfig(model="/models/m", min_acceptance_length=value)  # refused before the model is read


def test_a_replica_snapshot_carries_every_engine_figure():
    """ReplicaStats is EngineStats plus serving's own: a field the engine adds (the step cost table
    of the adaptive draft length) reaches /admin/stats instead of failing every request's stats."""
    engine_fields = {f.name for f in dataclasses.fields(EngineStats)}
    assert engine_fields <= {f.name for f in dataclasses.fields(ReplicaStats)}
    engine = EngineStats(8, 6, 1, 0, 0.5, 2.5, step_costs=(("target", 1, 4, 2.5),), acceptance_rates=(0.8,),
                         draft_length=3)
    snapshot = ReplicaStats.of(engine, num_in_flight=1, num_aborted=0, is_healthy=True)
    assert snapshot.step_costs == (("target", 1, 4, 2.5),) and snapshot.draft_length == 3
