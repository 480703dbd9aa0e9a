"""A request's state inside the engine core: token ids, KV progress, drafts and timings. No text: the
front end detokenizes (entrypoints/output_processor.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from warpspec.core.messages import RequestDelta
from warpspec.outputs import PositionLogprobs
from warpspec.sample.keyed_random import KeyedRandom
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode.draft_length import AcceptanceEstimate
from warpspec.spec_decode.speculation_stats import speculation_metrics

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    random: KeyedRandom  # every draw keyed by the request's seed and the position it decides
    output_token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose keys/values are in the KV cache
    # With a draft: of those, the leading positions whose draft KV is written too. The draft reads a
    # position after the target's step, or later from a backlog (speculation.py), and the prefix cache
    # shares no block past it (num_shareable). None without a draft.
    num_drafted: int | None = None
    num_cached_prompt_tokens: int | None = None  # prompt tokens the prefix cache supplied at admission
    # Its place in the scheduler's order (lower first): priority and arrival, set when it is queued.
    rank: tuple[int, int] = (0, 0)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[PositionLogprobs] | None = None  # of the output tokens not yet handed out
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    # Steps that ran its prompt tokens: (start, end) seconds since arrival and tokens, until handed out.
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Prompt then outputs; what the model has seen or will see.
    all_token_ids: list[int] = field(init=False)
    num_streamed_tokens: int = 0  # output tokens already handed out as deltas
    # Speculation: the proposer's drafts for the next step (kept through a preemption, to be verified
    # when the request is recomputed), and what verification made of them.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [num_drafts, vocab] when sampled by rejection sampling's rules
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Its own chance of each draft's acceptance (spec_decode/draft_length.py), from its first verification.
    acceptance: AcceptanceEstimate | None = field(default=None, repr=False)
    # Positions draft_backlog_start .. draft_backlog_end - 1, which the draft has not read yet: the
    # target's features there ([n, 3 * hidden] per step), kept while the request decodes without
    # drafts (speculation.py).
    draft_backlog: list[torch.Tensor] = field(default_factory=list, repr=False)
    draft_backlog_start: int = 0
    draft_backlog_end: int = 0

    @property
    def draft_backlog_len(self) -> int:
        return self.draft_backlog_end - self.draft_backlog_start if self.draft_backlog else 0
    # A structured output's matcher, at the end of output_token_ids (the engine core builds it).
    grammar: LLMatcher | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_shareable(self) -> int:
        """Leading tokens whose KV, the draft's too, is complete: what the prefix cache may share."""
        return self.num_cached if self.num_drafted is None else min(self.num_cached, self.num_drafted)

    def reset_cached(self, num_cached: int) -> None:
        """KV blocks taken from the prefix cache (num_cached tokens) or given back (0). A cached
        block holds the draft's KV as well as the target's."""
        self.num_cached = num_cached
        if self.num_drafted is not None:
            self.num_drafted = num_cached

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.finish_time = time.perf_counter()

    def metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {"prompt_tokens": len(self.prompt_token_ids),
                                     "completion_tokens": len(self.output_token_ids),
                                     "cached_prompt_tokens": self.num_cached_prompt_tokens or 0}
        if self.first_scheduled_time is not None:
            metrics["queue_time_s"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            metrics["time_to_first_token_s"] = self.first_token_time - self.arrival_time
        metrics.update(speculation_metrics(self.num_verify_steps, self.num_draft_tokens, self.num_accepted_tokens))
        if self.finish_time is not None and self.first_token_time is not None and len(self.output_token_ids) > 1:
            metrics["time_per_output_token_s"] = (self.finish_time - self.first_token_time) / (
                len(self.output_token_ids) - 1
            )
        return metrics

    def take_delta(self, num_draft_tokens: int = 0) -> RequestDelta:
        """What the front end has not heard yet: the new output tokens and their logprobs; the prompt
        logprobs and the metrics known so far with the first tokens (the front end needs them to finish
        a request that a stop string ends before the core does); the final metrics at the end.
        num_draft_tokens: the drafts this step verified."""
        is_first = self.num_streamed_tokens == 0
        tokens = self.output_token_ids[self.num_streamed_tokens :]
        self.num_streamed_tokens = len(self.output_token_ids)
        logprobs = self.new_logprobs
        if logprobs is not None:
            self.new_logprobs = []
        chunks, self.prefill_chunks = tuple(self.prefill_chunks), []
        return RequestDelta(self.request_id, tokens, self.finish_reason, self.stop_reason, logprobs,
                            self.prompt_logprobs if is_first else None,
                            self.metrics() if is_first or self.finish_reason is not None else {},
                            num_draft_tokens, prefill_chunks=chunks)
