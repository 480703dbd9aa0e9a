"""Speculative decoding beside the engine core's step: after the target's step, bring the proposer up
to date on what the target kept and ask it for the next drafts, as many per request as the draft
length policy chooses (spec_decode/draft_length.py) from the step costs measured here
(spec_decode/cost_model.py: timed at start-up, then followed from real steps); count what each
verification accepted.

A request that drafts nothing keeps its new positions' features for the draft to read later, in one
call (its backlog, _with_backlogs). Sequence.num_drafted follows what the draft has read: the
scheduler lets the prefix cache share a block only once it has, since the block holds the draft's KV
too. The draft reads every prompt at once.
"""

from __future__ import annotations

import time

import torch

from warpspec.config.engine import EngineConfig
from warpspec.core.block_manager import BlockManager
from warpspec.core.scheduler import ScheduledSequence
from warpspec.core.sequence import Sequence
from warpspec.sample.keyed_random import KeyedRandom
from warpspec.spec_decode.cost_model import StepCostModel
from warpspec.spec_decode.draft_length import DraftLengthPolicy, DraftWant
from warpspec.spec_decode.proposer import DraftRequest, Proposer
from warpspec.spec_decode.speculation_stats import SpeculationStats
from warpspec.workers.kv_groups import KVGroupLayout
from warpspec.workers.step import SequenceStep, StepPlan

# A request decoding without drafts calls the draft once per this many positions (_with_backlogs).
DRAFT_BACKLOG = 128
# Batch sizes the step cost model times at start-up: ~1 s on the bundled pair on 2 CPU cores.
TIMED_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class Speculation:
    def __init__(self, config: EngineConfig, proposer: Proposer, executor, block_manager: BlockManager,
                 kv_layout: KVGroupLayout, max_model_len: int, step_costs: StepCostModel):
        """executor: the engine core's (its steps are timed at start-up). step_costs: the engine's
        cost model, which this fills and follows."""
        self.config = config
        self.proposer = proposer
        self.executor = executor
        self.block_manager = block_manager
        self.kv_layout = kv_layout
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.step_costs = step_costs
        self.policy = self._draft_length_policy()
        # The adaptive draft length times each step; on a GPU only a synchronize makes that its work.
        # Sampling waits for the logits right after anyway.
        self.times_gpu_steps = self.policy.adaptive and config.device.startswith("cuda")
        self.released: list[str] = []  # finished or aborted since the proposer last heard

    def release(self, request_id: str) -> None:
        """Tell the proposer, with its next call, to forget a request that left."""
        self.released.append(request_id)

    def _draft_length_policy(self) -> DraftLengthPolicy:
        k = self.config.speculative.num_speculative_tokens
        graphs = self.config.cuda_graph_config()
        # Only the lengths whose steps run compiled, or as CUDA graphs: any other runs eagerly and
        # costs more than the drafts it would save (verification is k + 1 there).
        lengths = tuple(q - 1 for q in graphs.query_lens) if graphs is not None else tuple(range(k + 1))
        return DraftLengthPolicy(k, lengths, self.step_costs,
                                 adaptive=self.config.speculative.speculative_policy == "adaptive",
                                 padded=graphs is not None)

    def time_steps(self) -> tuple[str, list[str]]:
        """The step cost model's first figures: the target's step and the draft's proposals at every
        length a step may choose, for each of TIMED_BATCH_SIZES up to max_num_seqs (a larger batch
        reads past them, never cheaper, until its real steps correct it). Best of 3 each. The stand-in
        sequences run in the first blocks, which no request holds yet; returns what was timed, and
        their ids, which the executor's batch must drop with the next step."""
        sizes = [b for b in TIMED_BATCH_SIZES if b <= self.config.scheduler.max_num_seqs]
        ids = [f"step-cost-{i}" for i in range(max(sizes))]
        aux_layer_ids = list(self.proposer.aux_layer_ids)
        k = self.policy.max_drafts
        # Blocks for a backlog's catch-up, or the verified tokens and the drafts after them.
        table = list(range(-(-(DRAFT_BACKLOG + 2 * k + 1) // self.block_size)))
        for num_drafts in self.policy.lengths:
            q = num_drafts + 1
            # Without drafts the draft reads a backlog once per DRAFT_BACKLOG steps (_with_backlogs).
            num_positions, share = (DRAFT_BACKLOG, DRAFT_BACKLOG) if num_drafts == 0 else (q, 1)
            for b in sizes:
                windows = [table] * self.kv_layout.num_window_groups  # a hybrid cache's chunked groups
                plan = StepPlan([SequenceStep([0] * q, 0, table, 0, ids[i], windows) for i in range(b)],
                                self.block_size, aux_layer_ids, chunk_size=self.kv_layout.chunk_size)
                target, draft = [], []
                for _ in range(3):
                    start = time.perf_counter()
                    output = self.executor.execute(plan)
                    if self.times_gpu_steps:
                        torch.cuda.synchronize()
                    target.append(time.perf_counter() - start)
                    features = [torch.cat(output.aux_hidden, dim=-1)[:1].expand(b * num_positions, -1).contiguous()
                                ] if output.aux_hidden else []  # a proposer reading no layers gets none
                    requests = [DraftRequest(ids[i], [0] * num_positions, 0, i * num_positions, num_drafts, table,
                                             0.0, KeyedRandom(0), context=[0] * (num_positions + 1))
                                for i in range(b)]
                    start = time.perf_counter()
                    self.proposer.propose(requests, features)  # its drafts come back as lists: waited for
                    draft.append((time.perf_counter() - start) / share)
                self.step_costs.set("target", b, q, min(target))
                self.step_costs.set("draft", b, num_drafts, min(draft))
        self.proposer.release(ids)
        return f"{len(sizes)} batch sizes x draft lengths {', '.join(map(str, self.policy.lengths))}", ids

    def observe_step(self, scheduled: list[ScheduledSequence], plan: list[SequenceStep], execute_s: float,
                           host_s: float) -> None:
        """Every step counts in the cost model (how stale each figure is); a step of decodes and
        verifications only (no prompt chunk) updates it: the target's step, and the rest of the step
        outside the target and the draft (host_s)."""
        if not self.policy.adaptive:
            return
        self.step_costs.advance()
        if not all(item.samples and len(item.token_ids) == len(item.draft_token_ids) + 1 for item in scheduled):
            return
        lengths = [len(p.token_ids) for p in plan]
        if min(lengths) == max(lengths):
            self.step_costs.observe_target(len(lengths), lengths[0], execute_s)
        else:
            self.step_costs.observe_mixed(len(lengths), max(lengths), execute_s)
        self.step_costs.observe_host(len(lengths), max(lengths), host_s)

    def count_acceptance(self, stats: SpeculationStats, seq: Sequence, num_drafts: int, accepted: int) -> None:
        """One verification of seq's num_drafts drafts, accepted of them accepted: into the engine's
        stats, the request's own counts and the draft length policy's estimates."""
        seq.num_verify_steps += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += accepted
        stats.num_verify_steps += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        if seq.grammar is not None:
            stats.num_constrained_verify_steps += 1
            stats.num_constrained_accepted_tokens += accepted
        for position in range(num_drafts):
            stats.proposed_at[position] = stats.proposed_at.get(position, 0) + 1
            if position < accepted:
                stats.accepted_at[position] = stats.accepted_at.get(position, 0) + 1
        if seq.acceptance is not None:
            self.policy.observe(seq.acceptance, num_drafts, accepted)

    def propose(self, scheduled: list[ScheduledSequence], step_lens: list[int], aux_hidden: list[torch.Tensor],
                 num_rejected: dict[str, int]) -> None:
        """Bring the draft up to date on every position the target computed this step, and ask it for
        the next drafts of each sequence that will decode next step: as many as the draft length
        policy chooses for that batch (spec_decode/draft_length.py)."""
        requests, live, token_start = [], [], 0
        for item, step_len in zip(scheduled, step_lens, strict=True):
            seq = item.seq
            valid = len(item.token_ids) - num_rejected.get(seq.request_id, 0)
            feature_start, token_start = token_start, token_start + step_len  # padding included
            if item.samples:  # its drafts were verified; a mid-prefill chunk keeps them for later
                seq.draft_token_ids, seq.draft_probs = [], None
            if seq.finish_reason is not None:
                continue
            first = item.num_cached
            requests.append(DraftRequest(
                seq.request_id, seq.all_token_ids[first + 1 : first + 1 + valid], first, feature_start, 0,
                self.block_manager.block_tables[seq.request_id], seq.params.temperature,
                seq.random, self.config.speculative.coupled_verification, seq.grammar, seq.all_token_ids))
            live.append(item)
        decoding = [i for i, item in enumerate(live) if item.samples]
        wants = [self._draft_want(live[i].seq) for i in decoding]
        for i, num_drafts in zip(decoding, self.policy.choose(wants), strict=True):
            requests[i].num_drafts = num_drafts
        requests, live, aux_hidden = self._with_backlogs(requests, live, aux_hidden)
        if self.released:  # before the proposals: a request id may come back once it has left
            self.proposer.release(self.released)
            self.released = []
        start = time.perf_counter()
        proposals = self.proposer.propose(requests, aux_hidden)
        self._observe_draft_cost(requests, live, time.perf_counter() - start)
        for r, item, drafts in zip(requests, live, proposals, strict=True):
            item.seq.num_drafted = r.first_position + r.num_positions
            if item.samples:
                item.seq.draft_token_ids, item.seq.draft_probs = drafts.token_ids, drafts.probs

    def _observe_draft_cost(self, requests: list[DraftRequest], live: list[ScheduledSequence], seconds: float) -> None:
        """A proposal for decoding requests alone updates the cost model: k drafts each after a catch-up
        of at most k + 1 positions (the steady state), or only backlogs caught up, which stand for the
        steps that did not call the draft (per step: the time over the positions each caught up on).
        A catch-up over a prompt, or a backlog caught up as drafting resumes, is no step's usual cost."""
        if (not self.policy.adaptive or not requests or not all(item.samples for item in live)
                or len({r.num_drafts for r in requests}) > 1):
            return
        if any(r.first_position < len(item.seq.prompt_token_ids) for r, item in zip(requests, live, strict=True)):
            return  # a prompt's last chunk, read at once
        num_drafts, positions = requests[0].num_drafts, [r.num_positions for r in requests]
        if num_drafts and max(positions) <= self.policy.max_drafts + 1:
            self.step_costs.observe_draft(len(requests), num_drafts, seconds)
        elif not num_drafts and min(positions) > self.policy.max_drafts + 1:
            self.step_costs.observe_draft(len(requests), 0, seconds * len(positions) / sum(positions))

    def _with_backlogs(self, requests: list[DraftRequest], live: list[ScheduledSequence],
                       aux_hidden: list[torch.Tensor]) -> tuple[list[DraftRequest], list[ScheduledSequence],
                                                                list[torch.Tensor]]:
        """The requests to send the proposer, their items, and the features they read. A decoding
        request that drafts nothing this time keeps its new positions' features instead (its backlog):
        a plain step should cost the target's step alone, and the draft's catch-up costs about half of
        that at batch 1 here (1.2 against 2.2 ms). Every DRAFT_BACKLOG positions, or as soon as it
        drafts again, it catches up on them all in one call, one step of a few rows instead of many of
        one. The features of what is sent then form one tensor, the backlogs' rows before each
        request's own: [a0 a1 | b0] with a's backlog [a_-2 a_-1] -> [a_-2 a_-1 a0 a1 | b0]. A
        proposer that reads no features (no aux layers) has nothing to keep: it hears every step."""
        if not self.policy.adaptive or not aux_hidden:
            return requests, live, aux_hidden
        features = None  # this step's [num_tokens, 3 * hidden], read only where a backlog changes
        sent, sent_live, caught_up = [], [], {}  # caught_up: index in sent -> its rows, backlog first
        for r, item in zip(requests, live, strict=True):
            seq = item.seq
            if seq.draft_backlog and seq.draft_backlog_end != r.first_position:
                seq.draft_backlog = []  # recomputed after a preemption: this catch-up covers it again
            # A prompt is read at once: the prefix cache shares its blocks only with the draft's KV in them.
            defer = (item.samples and r.num_drafts == 0 and r.first_position >= len(seq.prompt_token_ids)
                     and seq.draft_backlog_len + r.num_positions < DRAFT_BACKLOG)
            if not defer and not seq.draft_backlog:
                sent.append(r)
                sent_live.append(item)
                continue
            if features is None:
                features = torch.cat(aux_hidden, dim=-1)
            rows = features[r.feature_start : r.feature_start + r.num_positions]
            if defer:
                if not seq.draft_backlog:
                    seq.draft_backlog_start = r.first_position
                seq.draft_backlog.append(rows)  # a view: a decode step's features are a few rows in all
                seq.draft_backlog_end = r.first_position + r.num_positions
                continue
            rows = caught_up[len(sent)] = torch.cat([*seq.draft_backlog, rows])
            r.first_position = seq.draft_backlog_start
            r.token_ids = seq.all_token_ids[r.first_position + 1 : r.first_position + 1 + rows.shape[0]]
            seq.draft_backlog = []
            sent.append(r)
            sent_live.append(item)
        if not caught_up:
            return sent, sent_live, aux_hidden
        parts, num_rows = [], 0
        for index, r in enumerate(sent):
            rows = caught_up.get(index)
            if rows is None:
                rows = features[r.feature_start : r.feature_start + r.num_positions]
            r.feature_start, num_rows = num_rows, num_rows + rows.shape[0]
            parts.append(rows)
        return sent, sent_live, [torch.cat(parts)]

    def _draft_want(self, seq: Sequence) -> DraftWant:
        """How many drafts seq may verify next step, and what it has accepted so far."""
        params = seq.params
        most = 0
        if not params.has_penalties and params.speculation is not False:
            # Never past max_model_len, and no more than the output still allowed. Never fewer
            # because KV blocks are short: a request's steps, and so its seeded tokens, must not
            # depend on the crowd (the scheduler preempts for the verification's blocks instead).
            most = max(0, min(self.policy.max_drafts, params.max_tokens - len(seq.output_token_ids) - 1,
                              self.max_model_len - seq.num_tokens))
        if seq.acceptance is None:
            seq.acceptance = self.policy.new_estimate()
        # A seeded sample verified by rejection sampling drafts as many as it may at every step: its
        # tokens depend on how many drafts each step verified, which must not depend on the crowd.
        fixed = params.seed is not None and not params.is_greedy and not self.config.speculative.coupled_verification
        return DraftWant(most, seq.acceptance, fixed)

