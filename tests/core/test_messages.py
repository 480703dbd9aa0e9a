"""Merging the core's replies (StepReply.then): what the front end gets from merged steps is what it
would have got from each, and what it must not wait for is told apart."""

from __future__ import annotations

from warpspec.core.engine_stats import EngineStats
from warpspec.core.messages import RequestDelta, StepReply
from warpspec.errors import StepFailedError
from warpspec.outputs import Logprob
from warpspec.spec_decode.speculation_stats import SpeculationStats


def _stats(num_running: int) -> EngineStats:
    return EngineStats(num_kv_blocks=8, num_free_kv_blocks=8 - num_running, num_running=num_running,
                       num_waiting=0, prefix_cache_hit_rate=0.0, acceptance_length=0.0)


def _logprobs(token: int) -> dict[int, Logprob]:
    return {token: Logprob(-0.5, 1)}


def test_two_steps_merge_per_request_in_step_order():
    first = StepReply([RequestDelta("a", [5], new_logprobs=[_logprobs(5)], num_draft_tokens=3),
                       RequestDelta("b", [7, 8], num_draft_tokens=3)],
                      _stats(2), SpeculationStats(num_draft_tokens=6), sent_at=1.0)
    second = StepReply([RequestDelta("b", [9], "length", metrics={"ttft_s": 0.1}, num_draft_tokens=3),
                        RequestDelta("a", [6, 4], "stop", 4, [_logprobs(6), _logprobs(4)], num_draft_tokens=3)],
                       _stats(0), SpeculationStats(num_draft_tokens=12), sent_at=2.0)
    merged = first.then(second)
    a, b = merged.deltas  # in the order the requests first appeared
    assert (a.request_id, a.new_token_ids, a.finish_reason, a.stop_reason) == ("a", [5, 6, 4], "stop", 4)
    assert a.new_logprobs == [_logprobs(5), _logprobs(6), _logprobs(4)] and a.num_draft_tokens == 6
    assert (b.new_token_ids, b.finish_reason, b.new_logprobs, b.metrics) == ([7, 8, 9], "length", None,
                                                                            {"ttft_s": 0.1})
    assert merged.stats == _stats(0) and merged.spec_stats.num_draft_tokens == 12 and merged.sent_at == 2.0


def test_first_tokens_ends_and_failures_are_urgent_and_middle_steps_are_not():
    middle = StepReply([RequestDelta("a", [5])], _stats(1), SpeculationStats())
    assert not middle.is_urgent
    first = RequestDelta("b", [3], prompt_logprobs=[None, _logprobs(2)], metrics={"queue_s": 0.0})
    assert StepReply([first], _stats(1), SpeculationStats()).is_urgent
    assert StepReply([RequestDelta("a", [6], "length")], _stats(0), SpeculationStats()).is_urgent
    failed = StepReply([], _stats(0), SpeculationStats(), [StepFailedError(["a"], "bad tensor")])
    assert failed.is_urgent and middle.then(failed).failures == failed.failures
