"""The step cost model: figures between and beyond the batch sizes timed, and what one step moves."""

from __future__ import annotations

import pytest

from warpspec.spec_decode.cost_model import ALPHA, MAX_WEIGHT, StepCostModel


def test_unseen_batch_sizes_read_between_and_beyond_the_timed_ones():
    costs = StepCostModel()
    costs.set("target", 8, 4, 0.010)
    costs.set("target", 16, 4, 0.018)
    assert costs.target_time(12, 4) == pytest.approx(0.014)  # halfway: (10 + 18) / 2 ms
    assert costs.target_time(32, 4) == pytest.approx(0.034)  # along the last slope: 18 + 16 x 1 ms
    assert costs.target_time(4, 4) == pytest.approx(0.010)  # below the smallest: no cheaper than it
    assert costs.target_time(8, 1) is None  # another length: nothing known
    assert costs.draft_time(8, 3) is None


def test_a_mixed_step_never_seen_reads_as_a_uniform_one_of_its_longest_length():
    costs = StepCostModel()
    costs.set("target", 8, 4, 0.010)
    assert costs.mixed_time(8, 4) == pytest.approx(0.010)
    costs.observe_mixed(8, 4, 0.015)  # the first of its shape starts from that, then moves
    assert costs.mixed_time(8, 4) == pytest.approx(0.010 + ALPHA * 0.005)


def test_a_step_moves_its_figure_a_fraction_and_one_outlier_at_most_twice_that():
    costs = StepCostModel()
    costs.observe_draft(8, 3, 0.003)  # nothing known: taken as it is
    assert costs.draft_time(8, 3) == pytest.approx(0.003)
    costs.observe_draft(8, 3, 0.004)
    assert costs.draft_time(8, 3) == pytest.approx(0.003 + ALPHA * 0.001)
    before = costs.draft_time(8, 3)
    costs.observe_draft(8, 3, 0.055)  # the draft's KV cache grew: counted as twice the figure
    assert costs.draft_time(8, 3) == pytest.approx(before + ALPHA * before)
    rows = costs.rows()
    assert rows == [{"step": "draft", "num_seqs": 8, "length": 3, "ms": round(costs.draft_time(8, 3) * 1e3, 4)}]


def test_past_the_largest_size_a_figure_never_falls_whatever_its_neighbours_say():
    """On the H200 two neighbouring batch sizes read 0.63 then 0.54 ms of host time: along their slope
    the next sizes read negative, and steps starting from those figures drove them to -1e9."""
    costs = StepCostModel()
    for num_seqs, ms in ((1, 0.36), (8, 0.49), (15, 0.63), (16, 0.54)):
        costs.observe_host(num_seqs, 1, ms / 1e3)
    # From batch 8 (at most half of 16): +0.05 / 8 ms a sequence, never the -0.09 of 15 -> 16.
    assert costs.host_time(32, 1) == pytest.approx((0.54 + 0.05 / 8 * 16) / 1e3)
    costs.observe_host(64, 1, -0.001)  # a step never takes negative time: read as 0
    assert costs.host_time(64, 1) == 0.0 and costs.host_time(100, 1) >= 0.0


def test_the_host_time_of_a_step_follows_its_length_and_reads_the_nearest_before_one_ran():
    """The bundled pair at batch 32: 1.17 ms around a verification of 4 tokens, 0.63 around a decode."""
    costs = StepCostModel()
    assert costs.host_time(32, 1) is None
    costs.observe_host(32, 4, 1.17e-3)
    assert costs.host_time(32, 1) == pytest.approx(1.17e-3)  # no plain decode yet: the verification's
    costs.observe_host(32, 1, 0.63e-3)
    assert costs.host_time(32, 1) == pytest.approx(0.63e-3) and costs.host_time(32, 4) == pytest.approx(1.17e-3)
    assert costs.host_time(32, 2) == pytest.approx(0.63e-3) and costs.host_time(32, 3) == pytest.approx(1.17e-3)
    costs.observe_host(32, 1, 0.73e-3)  # moves only its own length's figure
    assert costs.host_time(32, 1) == pytest.approx((0.63 + ALPHA * 0.1) * 1e-3)
    assert costs.host_time(32, 4) == pytest.approx(1.17e-3)


def test_a_figure_not_observed_for_steps_moves_as_far_as_those_steps_would_have_moved_it():
    """Batch 64 on the bundled pair: plain steps ran while the verification's figure kept its warm-up
    reading (22.4 ms) long after the steps it stood for took less. A figure observed at every step
    moves ALPHA; one last observed 3 steps ago, 1 - (1 - ALPHA)^3; a figure stale for many steps moves
    at most MAX_WEIGHT (one step is noisy)."""
    costs = StepCostModel()
    costs.set("target", 64, 1, 0.0063)
    costs.set("target", 64, 4, 0.0224)
    for _ in range(3):
        costs.advance()
        costs.observe_target(64, 1, 0.0073)
    fresh = 0.0063 + (0.0073 - 0.0063) * (1 - (1 - ALPHA) ** 3)
    assert costs.target_time(64, 1) == pytest.approx(fresh)  # three steps of ALPHA each
    costs.advance()
    costs.observe_target(64, 4, 0.0204)  # last observed 4 steps ago, at warm-up
    assert costs.target_time(64, 4) == pytest.approx(0.0224 - 0.0020 * (1 - (1 - ALPHA) ** 4))
    for _ in range(100):
        costs.advance()
    costs.observe_target(64, 1, 0.0095)
    assert costs.target_time(64, 1) == pytest.approx(fresh + MAX_WEIGHT * (0.0095 - fresh))
