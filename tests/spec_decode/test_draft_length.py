"""The draft length policy: the length of the most tokens per second, from measured costs and
acceptance; seeded samples and requests that may draft less keep their own; the fixed policy."""

from __future__ import annotations

import pytest

from warpspec.spec_decode.cost_model import StepCostModel
from warpspec.spec_decode.draft_length import (
    MIN_OBSERVED,
    REFRESH_MARGIN,
    REFRESH_STEPS,
    RELAX,
    AcceptanceEstimate,
    DraftLengthPolicy,
    DraftWant,
)


def _costs() -> StepCostModel:
    """The module docstring's worked example at batch 32, and batch 1 where verification is nearly free."""
    costs = StepCostModel()
    for num_seqs, decode, verify, catch_up, propose in ((1, 2.2, 2.4, 0.1, 1.3), (32, 9.0, 19.0, 1.0, 4.0)):
        costs.set("target", num_seqs, 1, decode / 1e3)
        costs.set("target", num_seqs, 4, verify / 1e3)
        costs.set("draft", num_seqs, 0, catch_up / 1e3)
        costs.set("draft", num_seqs, 3, propose / 1e3)
    return costs


def _policy(adaptive: bool = True) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(3, (0, 3), _costs(), adaptive)
    for _ in range(MIN_OBSERVED):
        policy.observe(policy.new_estimate(), 3, 3)
    return policy


def _wants(rates: list[float], n: int, most: int = 3, fixed: bool = False) -> list[DraftWant]:
    return [DraftWant(most, AcceptanceEstimate(list(rates)), fixed) for _ in range(n)]


def test_expected_tokens_add_the_chance_of_each_draft():
    estimate = AcceptanceEstimate([0.8, 0.6, 0.4])
    assert estimate.expected_tokens(0) == 1.0 and abs(estimate.expected_tokens(3) - 2.8) < 1e-9
    estimate.observe(3, 1, alpha=0.5)  # the first accepted, the second rejected (and so the third)
    assert [round(r, 3) for r in estimate.rates] == [0.9, 0.3, 0.2]


def test_drafts_where_they_pay_and_decodes_plainly_where_they_do_not():
    policy = _policy()
    # Batch 32, r = [0.8, 0.6, 0.4]: 32 x 2.8 / 23 ms = 3.9 tokens/ms against 32 / 10 ms = 3.2.
    assert policy.choose(_wants([0.8, 0.6, 0.4], 32)) == [3] * 32 and policy.last_choice == 3
    # r = [0.6, 0.4, 0.2]: 32 x 2.2 / 23 ms = 3.06 tokens/ms, below plain decoding's 3.2 but within
    # SWITCH_MARGIN (10%) of it: k = 3, chosen last, stays.
    assert policy.choose(_wants([0.6, 0.4, 0.2], 32)) == [3] * 32
    # r = [0.3, 0.1, 0.0]: 32 x 1.4 / 23 ms = 1.9 tokens/ms (2.1 with the margin): plain decoding wins.
    assert policy.choose(_wants([0.3, 0.1, 0.0], 32)) == [0] * 32 and policy.last_choice == 0
    # r = [0.6, 0.4, 0.2] at batch 1, where a verification costs about a decode: 2.2 / 3.7 ms beats
    # 1 / 2.3 ms even with the margin plain decoding now has.
    assert policy.choose(_wants([0.6, 0.4, 0.2], 1)) == [3]
    assert policy.num_chosen == {3: 3, 0: 1}


def test_plain_decoding_pays_its_own_host_time_not_a_verifications():
    """Near the crossover the host's share decides. Batch 32, r = [0.8, 0.7, 0.6], 4 ms of host time
    around a verification: drafting yields 32 x 3.1 / (19 + 4 + 4) ms = 3.67 tokens/ms. A plain
    decode of 6 ms read with that host time, 32 / (6 + 1 + 4) = 2.91; with its own 0.5 ms, 32 / 7.5
    = 4.27."""
    policy = _policy()
    policy.costs.set("target", 32, 1, 0.006)
    policy.costs.observe_host(32, 4, 0.004)
    assert policy.choose(_wants([0.8, 0.7, 0.6], 32)) == [3] * 32
    policy.costs.observe_host(32, 1, 0.0005)  # a plain step ran
    policy.incumbent = None  # no margin for the length chosen last
    assert policy.choose(_wants([0.8, 0.7, 0.6], 32)) == [0] * 32


def test_a_length_that_has_not_run_for_a_while_runs_once_when_it_is_nearly_the_best():
    """Batch 32, r = [0.8, 0.6, 0.4]: a verification's figure read dear (26 ms: 32 x 2.8 / 30 ms =
    2.99 tokens/ms) puts drafting 7% behind plain decoding's 3.2. Plain runs, and once every
    REFRESH_STEPS steps drafting runs once, so that its figure follows what such a step takes now;
    the step after goes back to the best. A length the model puts more than REFRESH_MARGIN behind
    never runs."""
    policy = _policy()
    policy.costs.set("target", 32, 4, 0.026)
    chosen = [policy.choose(_wants([0.8, 0.6, 0.4], 32))[0] for _ in range(2 * REFRESH_STEPS)]
    assert chosen == ([0] * (REFRESH_STEPS - 1) + [3]) * 2 and policy.num_refreshes == 2
    policy.costs.set("target", 32, 4, 0.019)  # what the refreshing steps found: drafting wins from now on
    assert [policy.choose(_wants([0.8, 0.6, 0.4], 32))[0] for _ in range(2)] == [3, 3]
    assert (1 - REFRESH_MARGIN) * 32 / (9 + 1) > 32 * 1.9 / (19 + 4)  # r = [0.5, 0.3, 0.1]: far behind
    policy = _policy()
    chosen = {policy.choose(_wants([0.5, 0.3, 0.1], 32))[0] for _ in range(3 * REFRESH_STEPS)}
    assert chosen == {0} and policy.num_refreshes == 0


def test_one_bad_step_of_a_large_batch_barely_moves_the_engines_estimate():
    """At batch 64 one step verifies 64 drafts at once. After 2,000 verifications realising 3.5
    tokens each, one step in which nothing was accepted leaves the engine's estimate (the prior of
    new requests, and what those that stopped drafting relax to) at 3.2; at the former 0.02 it fell
    to 1.7, near that step's 1."""
    policy = DraftLengthPolicy(3, (0, 3), _costs())
    for i in range(2000):
        policy.observe(policy.new_estimate(), 3, 3 if i % 2 else 2)
    assert policy.acceptance.expected_tokens(3) == pytest.approx(3.5, abs=0.01)
    for _ in range(64):
        policy.observe(policy.new_estimate(), 3, 0)
    assert policy.acceptance.expected_tokens(3) > 3.1


def test_seeded_samples_and_short_requests_keep_their_own_length():
    policy = _policy()
    wants = _wants([0.3, 0.1, 0.0], 30) + _wants([0.3, 0.1, 0.0], 1, fixed=True) + _wants([0.9] * 3, 1, most=1)
    # The seeded one drafts 3 whatever the step chooses, and the short one at most 1. Plain decoding
    # would be a mixed step, costed as a verification (none of its kind timed yet), for 32.4 tokens
    # against 30 x 1.4 + 1.4 + 1.9 = 45.3: everyone drafts.
    assert policy.choose(wants) == [3] * 31 + [1]
    # Once mixed steps are known to cost what a decode does, the others decode plainly: without the
    # short one, (30 + 1.4) / (9 + 4) ms against 31 x 1.4 / (19 + 4) ms.
    policy.costs.set("mixed", 32, 4, 0.009)
    assert policy.choose(wants[:31]) == [0] * 30 + [3]


def test_a_request_that_stopped_drafting_drifts_back_to_the_engines_estimate():
    policy = _policy()  # the engine's estimate: every draft accepted so far
    want = _wants([0.0, 0.0, 0.0], 1)[0]
    policy.costs.set("target", 1, 4, 0.010)  # make batch 1's verification dear: plain wins at first
    assert policy.choose([want]) == [0]
    assert [round(r, 3) for r in want.acceptance.rates] == [RELAX] * 3


def test_before_enough_verifications_and_under_the_fixed_policy_every_request_drafts_all_it_may():
    fresh = DraftLengthPolicy(3, (0, 3), _costs())
    assert fresh.choose(_wants([0.0] * 3, 32)) == [3] * 32 and fresh.last_choice is None
    fixed = _policy(adaptive=False)
    assert fixed.choose(_wants([0.0] * 3, 32) + _wants([0.0] * 3, 1, most=2)) == [3] * 32 + [2]
    unknown = DraftLengthPolicy(3, (0, 3), StepCostModel())  # nothing timed: nothing to choose from
    for _ in range(MIN_OBSERVED):
        unknown.observe(unknown.new_estimate(), 3, 0)
    assert unknown.choose(_wants([0.0] * 3, 4)) == [3] * 4
