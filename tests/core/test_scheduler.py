"""The scheduler and block manager alone: no model, just bookkeeping and its invariants."""

from __future__ import annotations

import torch

from warpspec.config.engine import SchedulerConfig
from warpspec.core.block_manager import BlockManager, prefix_block_hashes
from warpspec.core.scheduler import Scheduler
from warpspec.core.sequence import Sequence
from warpspec.sampling_params import SamplingParams


def _seq(request_id: str, prompt: list[int], prompt_logprobs: int | None = None, priority: int = 0) -> Sequence:
    return Sequence(request_id, None, prompt, SamplingParams(prompt_logprobs=prompt_logprobs, priority=priority),
                    torch.Generator())


def _run(scheduler: Scheduler):
    """One step as the engine does it: schedule, mark computed, append a token to each sampled seq."""
    out = scheduler.schedule()
    scheduler.update_after_step(out, {})
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(7)
    return out


def test_decodes_first_then_prefill_chunks_within_the_token_budget():
    manager = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10), manager)
    a = _seq("a", list(range(1, 7)))  # 6 tokens
    scheduler.add(a)
    assert [len(i.token_ids) for i in _run(scheduler).scheduled] == [6]
    b = _seq("b", list(range(20, 45)))  # 25 tokens: more than a step's budget
    scheduler.add(b)
    out = _run(scheduler)
    # a decodes 1 token; b gets the 9 left of the budget and does not sample yet.
    assert [(i.seq.request_id, len(i.token_ids), i.samples) for i in out.scheduled] == [("a", 1, True),
                                                                                        ("b", 9, False)]
    out = _run(scheduler)
    assert [(i.seq.request_id, len(i.token_ids), i.num_cached) for i in out.scheduled] == [("a", 1, 7), ("b", 9, 9)]
    out = _run(scheduler)
    assert [(i.seq.request_id, len(i.token_ids), i.samples) for i in out.scheduled] == [("a", 1, True),
                                                                                        ("b", 7, True)]


def test_max_num_seqs_caps_the_running_set():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(64, 4))
    for i in range(3):
        scheduler.add(_seq(f"s{i}", [1, 2, 3]))
    out = _run(scheduler)
    assert [i.seq.request_id for i in out.scheduled] == ["s0", "s1"]
    assert [s.request_id for s in scheduler.waiting] == ["s2"]


def test_out_of_blocks_preempts_the_latest_arrival_and_recomputes_it_later():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(), manager)
    first, second = _seq("first", list(range(1, 9))), _seq("second", list(range(11, 19)))
    scheduler.add(first)
    scheduler.add(second)
    _run(scheduler)  # both prefill: 2 blocks each, the cache is full
    assert manager.num_free_blocks == 0
    out = _run(scheduler)  # first needs a third block for its 9th token: second gives way
    assert [s.request_id for s in out.preempted] == ["second"]
    assert [i.seq.request_id for i in out.scheduled] == ["first"]
    assert second.num_cached == 0 and scheduler.waiting[0] is second
    assert second.output_token_ids == [7]  # kept: recompute re-runs prompt + outputs, it does not resample
    scheduler.remove(first)
    out = _run(scheduler)
    assert [(i.seq.request_id, i.token_ids) for i in out.scheduled] == [("second", list(range(11, 19)) + [7])]
    scheduler.remove(second)
    assert manager.num_free_blocks == 4


def test_waiting_sequences_hold_no_blocks():
    manager = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), manager)
    scheduler.add(_seq("big", list(range(1, 12))))
    _run(scheduler)
    scheduler.add(_seq("next", list(range(1, 9))))  # its first two blocks are cached, but it cannot run
    _run(scheduler)
    assert "next" not in manager.block_tables


def test_prefix_cache_hits_share_blocks_and_count_references():
    manager = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), manager)
    shared = list(range(1, 11))  # 10 tokens: two full blocks
    a = _seq("a", shared + [50, 51])
    scheduler.add(a)
    _run(scheduler)
    b = _seq("b", shared + [60])
    scheduler.add(b)
    out = _run(scheduler)
    item = next(i for i in out.scheduled if i.seq is b)
    assert item.num_cached == 8 and item.token_ids == [9, 10, 60]  # the two shared blocks were not recomputed
    assert manager.block_tables["a"][:2] == manager.block_tables["b"][:2]
    assert [manager.ref_counts[blk] for blk in manager.block_tables["b"][:2]] == [2, 2]
    assert manager.stats.hit_tokens == 8 and manager.stats.queried_tokens == 12 + 11
    scheduler.remove(a)
    scheduler.remove(b)
    assert manager.num_free_blocks == 16


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    manager = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), manager)
    scheduler.add(_seq("a", list(range(1, 11))))
    _run(scheduler)
    b = _seq("b", list(range(1, 11)), prompt_logprobs=1)
    scheduler.add(b)
    out = _run(scheduler)
    assert next(i for i in out.scheduled if i.seq is b).num_cached == 0


def test_eviction_takes_the_least_recently_freed_cached_block():
    manager = BlockManager(num_blocks=4, block_size=2)
    for name, tokens in (("old", [1, 2, 3]), ("new", [5, 6, 7])):
        manager.match_prefix(name, tokens)
        manager.allocate(name, 3)
        manager.cache_full_blocks(name, tokens, 2)
        manager.free(name)
    old_hash, new_hash = prefix_block_hashes([1, 2], 2)[0], prefix_block_hashes([5, 6], 2)[0]
    assert (0, old_hash) in manager.cached and (0, new_hash) in manager.cached
    manager.match_prefix("x", [9])
    manager.allocate("x", 6)  # three blocks from the front of the free queue: old tail, old head, new tail
    assert (0, old_hash) not in manager.cached and (0, new_hash) in manager.cached


def _ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_a_better_priority_takes_the_place_of_the_worst_running_one_when_the_batch_is_full():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(64, 4, enable_prefix_caching=False))
    low1, low2, low3, high = (_seq(name, [i, i + 1, i + 2], priority=p)
                              for i, (name, p) in enumerate([("low1", 1), ("low2", 1), ("low3", 1), ("high", 0)]))
    scheduler.add(low1)
    scheduler.add(low2)
    _run(scheduler)
    scheduler.add(high)
    scheduler.add(low3)
    out = _run(scheduler)
    # low2 arrived last of the running ones: it makes room, and it waits ahead of low3, which came later.
    assert _ids(out.preempted) == ["low2"] and scheduler.num_priority_preemptions == 1
    assert [(i.seq.request_id, len(i.token_ids)) for i in out.scheduled] == [("low1", 1), ("high", 3)]
    assert _ids(scheduler.running) == ["high", "low1"] and _ids(scheduler.waiting) == ["low2", "low3"]
    assert low2.num_cached == 0 and scheduler.block_manager.num_free_blocks == 64 - 2
    scheduler.remove(high)
    out = _run(scheduler)
    assert [(i.seq.request_id, len(i.token_ids)) for i in out.scheduled] == [("low1", 1), ("low2", 4)]
    assert not out.preempted and _ids(scheduler.waiting) == ["low3"]


def test_a_better_priority_whose_prompt_does_not_fit_preempts_until_it_does():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(), manager)
    a, b = _seq("a", list(range(1, 13)), priority=5), _seq("b", list(range(21, 33)), priority=5)
    scheduler.add(a)
    scheduler.add(b)
    _run(scheduler)  # 3 blocks each
    assert manager.num_free_blocks == 2
    urgent = _seq("urgent", list(range(41, 53)), priority=-5)  # 12 tokens: 3 blocks
    scheduler.add(urgent)
    out = _run(scheduler)
    assert _ids(out.preempted) == ["b"]
    assert [i.seq.request_id for i in out.scheduled] == ["a", "urgent"]
    assert _ids(scheduler.waiting) == ["b"]
    # An equal or worse priority never preempts: it waits for blocks as before.
    same = _seq("same", list(range(61, 73)), priority=5)
    scheduler.add(same)
    out = _run(scheduler)
    assert not out.preempted and _ids(scheduler.waiting) == ["b", "same"]


def test_aging_serves_an_old_request_before_better_ones_that_arrive_long_enough_after_it():
    """priority_aging_steps 2: priority 1 arriving at step s goes before priority 0 arriving at s + 2."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, priority_aging_steps=2), BlockManager(64, 4))
    scheduler.add(_seq("first", [1], priority=0))
    _run(scheduler)
    scheduler.add(_seq("old", [1], priority=1))
    started = []
    for step in range(6):
        scheduler.add(_seq(f"new{step}", [1], priority=0))
        scheduler.remove(scheduler.running[0])  # one finishes each step
        started += [i.seq.request_id for i in _run(scheduler).scheduled]
    assert started == ["new0", "new1", "old", "new2", "new3", "new4"]
    assert scheduler.num_priority_preemptions == 0  # nothing outranked the one running
