"""Continuous batching: which sequences run in the next step, and how many tokens each.

Pure CPU bookkeeping over Sequences and the BlockManager, returning a plain SchedulerOutput that the
engine turns into a model step. Every step fills a token budget: running sequences first (a decode
is 1 token, plus its draft tokens when speculating; an unfinished prefill continues with its next
chunk), then waiting ones, each prefilling as much as the budget leaves (chunked prefill).

Order. Sequences are served by rank, lower first: priority * priority_aging_steps + the step at which
the sequence arrived, then arrival order. With every priority equal (the default, 0) that is
first come, first served. With priorities, a request goes before every request of a priority one
better (one lower) that arrives priority_aging_steps steps or more after it, and before all of its own
priority that arrive after it: aging bounds how long a stream of better requests can starve it. A
rank never changes, so a preempted sequence keeps its place ahead of later arrivals. Both queues
stay sorted by rank.

Preemption. When KV blocks run out for a running sequence, the running sequence of the worst rank is
preempted: its blocks are freed and it returns to the queue in its place, to recompute its prompt
and outputs later (whatever the prefix cache still holds is not recomputed). When the batch is full
(max_num_seqs) or the first waiting sequence's first chunk does not fit in the free blocks, and it
outranks the worst running sequence, that one is preempted to make room for it.

A sequence's drafts run all together or not at all, and survive a preemption: the step that reaches
its last known token verifies every draft it has. Its steps, and so its seeded tokens, are then the
same however full the batch or the cache is.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from warpspec.config.engine import SchedulerConfig
from warpspec.core.block_manager import BlockManager
from warpspec.core.sequence import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    token_ids: list[int]  # tokens to run this step (a prefill chunk, a decode token, ...)
    num_cached: int  # tokens of the sequence already in the KV cache before this step
    draft_token_ids: list[int] = field(default_factory=list)  # appended to token_ids by the speculator
    samples: bool = False  # this step reaches the sequence's last known token: sample the next one

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.seq.params.prompt_logprobs is not None and self.num_cached < len(self.seq.prompt_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # by rank
        self.running: list[Sequence] = []  # by rank
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of them, those that made room for a better-ranked request
        self.num_steps = 0  # steps scheduled so far: the clock of priority aging
        self.num_arrivals = 0

    def add(self, seq: Sequence) -> None:
        seq.rank = (seq.params.priority * self.config.priority_aging_steps + self.num_steps, self.num_arrivals)
        self.num_arrivals += 1
        bisect.insort(self.waiting, seq, key=_rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.request_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        self._make_room_for_better_ranks(preempted)
        num_made_room = len(preempted)

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0:  # its verification waits for a step with room for all its drafts
                index += 1
                continue
            while not self.block_manager.can_allocate(seq.request_id, seq.num_cached + num_new):
                victim = self._preempt_worst()
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(self._schedule(seq, num_new))
                budget -= num_new
                index += 1

        # New sequences wait while the running ones are short of blocks.
        while (self.waiting and len(preempted) == num_made_room and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if any(seq is victim for victim in preempted):  # not recomputed in the step it was preempted
                break
            self._match_prefix(seq)
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0 or not self.block_manager.can_allocate(seq.request_id, seq.num_cached + num_new):
                # A waiting sequence holds no blocks, or two of them could each hold what the other needs.
                self._unmatch(seq)
                break
            del self.waiting[0]
            bisect.insort(self.running, seq, key=_rank)
            if seq.num_cached_prompt_tokens is None:  # first admission, not a recompute after preemption
                seq.num_cached_prompt_tokens = seq.num_cached
                self.block_manager.stats.queried_tokens += len(seq.prompt_token_ids)
                self.block_manager.stats.hit_tokens += seq.num_cached
            scheduled.append(self._schedule(seq, num_new))
            budget -= num_new

        if scheduled:
            self.num_steps += 1
        return SchedulerOutput(scheduled, preempted, self.config.max_num_batched_tokens - budget)

    def pad_to_compiled(self, scheduled: list[ScheduledSequence], compiled_lens: tuple[int, ...],
                        max_model_len: int) -> int:
        """The length every sequence's share of a step of decodes and verifications is padded to, so
        that the step runs compiled (or as a CUDA graph): the shortest of compiled_lens that holds the
        longest share, when max_model_len and the free blocks hold the padding (taken here); else 0
        (nothing padded). Without it a verification of fewer drafts than k (near max_tokens), or beside
        shorter ones (penalties, opted out), ran eagerly: 24 ms against 8.5 for the bundled pair at
        batch 8."""
        if not compiled_lens or not all(item.samples and len(item.token_ids) == len(item.draft_token_ids) + 1
                                        and not item.wants_prompt_logprobs for item in scheduled):
            return 0
        longest = max(len(item.token_ids) for item in scheduled)
        padded = min((q for q in compiled_lens if q >= longest), default=0)
        if not padded or any(item.num_cached + padded > max_model_len for item in scheduled):
            return 0
        # A share ending near its request's last block may need one more for the padding's KV: taken
        # when free (the request gives it back when it ends), else the step runs as it is.
        blocks = self.block_manager
        needed = sum(blocks.num_blocks_to_grow(item.seq.request_id, item.num_cached + padded) for item in scheduled)
        if needed > blocks.num_free_blocks:
            return 0
        for item in scheduled:
            blocks.allocate(item.seq.request_id, item.num_cached + padded)
        return padded

    def _make_room_for_better_ranks(self, preempted: list[Sequence]) -> None:
        """Preempt the worst-ranked running sequences while the first waiting one outranks them and
        cannot start otherwise: the batch is full, or its first chunk does not fit in the free blocks."""
        while self.waiting and self.running and _rank(self.waiting[0]) < _rank(self.running[-1]):
            seq = self.waiting[0]
            if len(self.running) < self.config.max_num_seqs:
                self._match_prefix(seq)
                num_new = self._num_new_tokens(seq, self.config.max_num_batched_tokens)
                fits = num_new > 0 and self.block_manager.can_allocate(seq.request_id, seq.num_cached + num_new)
                self._unmatch(seq)
                if fits:
                    return
            preempted.append(self._preempt_worst())
            self.num_priority_preemptions += 1

    def update_after_step(self, output: SchedulerOutput, num_rejected: dict[str, int]) -> None:
        """The step ran: its tokens are in the KV cache now, except rejected drafts, whose entries are
        rolled back (they are overwritten later, and never enter the prefix cache). Blocks full of
        them enter the prefix cache once the draft, if any, has read them too (Sequence.num_shareable):
        call this after the draft's proposals. A hybrid cache's chunked groups give back the blocks
        before the next step's chunk."""
        for item in output.scheduled:
            seq = item.seq
            seq.num_cached = item.num_cached + len(item.token_ids) - num_rejected.get(seq.request_id, 0)
            self.block_manager.cache_full_blocks(seq.request_id, seq.all_token_ids, seq.num_shareable)
            self.block_manager.release_passed_chunks(seq.request_id, seq.num_cached)

    @staticmethod
    def _num_new_tokens(seq: Sequence, budget: int) -> int:
        """Tokens seq runs this step within budget: what is not yet computed, then all of its drafts
        (1 + k positions verified in one step for a decoding sequence) or none. When the drafts do
        not fit, the chunk stops one token short of the last known one, so that no step samples where
        a verification belongs: 5 known + 3 drafts in a budget of 6 -> 4 now, 1 + 3 next step."""
        num_known = seq.num_tokens - seq.num_cached
        num_drafts = len(seq.draft_token_ids)
        if num_known + num_drafts <= budget or not num_drafts:
            return min(num_known + num_drafts, budget)
        return min(num_known - 1, budget)

    def _schedule(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        self.block_manager.allocate(seq.request_id, seq.num_cached + num_new)
        token_ids = seq.all_token_ids[seq.num_cached : seq.num_cached + num_new]
        drafts = seq.draft_token_ids[: num_new - len(token_ids)]
        return ScheduledSequence(seq, token_ids + drafts, seq.num_cached, draft_token_ids=drafts,
                                 samples=seq.num_cached + len(token_ids) == seq.num_tokens)

    def _match_prefix(self, seq: Sequence) -> None:
        # Prompt logprobs need logits at every prompt position, so such requests compute them all.
        if seq.params.prompt_logprobs is not None:
            self.block_manager.match_prefix(seq.request_id, [])
            return
        seq.reset_cached(self.block_manager.match_prefix(seq.request_id, seq.all_token_ids))

    def _unmatch(self, seq: Sequence) -> None:
        """Give back the cached blocks _match_prefix gave a sequence that does not start now."""
        self.block_manager.free(seq.request_id)
        seq.reset_cached(0)

    def _preempt_worst(self) -> Sequence:
        """Send the running sequence of the worst rank back to the queue, in its place."""
        seq = self.running.pop()
        self.block_manager.free(seq.request_id)
        seq.reset_cached(0)  # its drafts stay: they are verified once it is recomputed
        bisect.insort(self.waiting, seq, key=_rank)
        self.num_preemptions += 1
        return seq


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.rank
