"""What crosses between the front end and the engine core. In: the requests added and aborted
(CoreInput), sent fire-and-forget whenever the replica has some. Out: one RequestDelta per request
that gained tokens or finished in a step; with Ray workers, StepReplies carry them on one long-lived
Ray stream, one per core step or, between a request's first tokens and its end, one per
core_reply_interval_ms of steps merged (StepReply.then).

A delta carries token ids, the core's finish reason (an eos or stop token, a length limit), the
requested logprobs and, once, what a request needs at its start (prompt logprobs, the metrics known
at the first token) or end (metrics): no text and nothing of vocabulary or hidden size. The front
end detokenizes, checks stop strings and builds full RequestOutputs (entrypoints/output_processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from warpspec.core.engine_stats import EngineStats
from warpspec.core.requests import NewRequest
from warpspec.errors import StepFailedError
from warpspec.outputs import PositionLogprobs
from warpspec.spec_decode.speculation_stats import SpeculationStats


@dataclass
class CoreInput:
    """The replica's n-th message to the core (numbered from 0: the core applies them in this order).
    The core drops aborts before it admits adds: an abort names only a request sent in an earlier
    message, since the replica drops an abort of one it has not sent yet."""
    number: int
    adds: list[NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


@dataclass
class RequestDelta:
    """What one step did to one request, as the engine core sees it (Sequence.take_delta)."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (eos or a stop token) or "length"; stop strings are the front end's
    stop_reason: int | None = None  # the stop token id
    new_logprobs: list[PositionLogprobs] | None = None  # one per new token, when requested
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the request's first delta
    metrics: dict[str, float] = field(default_factory=dict)  # on the first delta and the last
    num_draft_tokens: int = 0  # drafts this step verified: new_token_ids holds the accepted ones plus one
    num_steps: int = 1  # steps merged into this delta (then)
    # On the request's first delta: each step that ran prompt tokens before it, as (start, end) seconds
    # since the request arrived and the prompt tokens it ran.
    prefill_chunks: tuple[tuple[float, float, int], ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: RequestDelta) -> RequestDelta:
        """This delta and a later step's of the same request as one, as if the steps had been one."""
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return RequestDelta(self.request_id, self.new_token_ids + later.new_token_ids, later.finish_reason,
                            later.stop_reason, logprobs,
                            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
                            {**self.metrics, **later.metrics}, self.num_draft_tokens + later.num_draft_tokens,
                            self.num_steps + later.num_steps, self.prefill_chunks + later.prefill_chunks)


@dataclass
class StepReply:
    """What the core sends after a step (or several merged), or after applying messages that ran no
    step (an abort of the last request: the replica then sees its blocks free)."""
    deltas: list[RequestDelta]
    stats: EngineStats  # after the step
    spec_stats: SpeculationStats
    failures: list[StepFailedError] = field(default_factory=list)  # requests the core dropped, and why
    sent_at: float = 0.0  # time.monotonic() in the core: a stream lag, comparable on the same node only

    def then(self, later: StepReply) -> StepReply:
        """This reply and the next as one: each request's deltas merged in step order, the later stats."""
        merged = {delta.request_id: delta for delta in self.deltas}
        for delta in later.deltas:
            earlier = merged.get(delta.request_id)
            merged[delta.request_id] = delta if earlier is None else earlier.then(delta)
        return StepReply(list(merged.values()), later.stats, later.spec_stats, self.failures + later.failures,
                         later.sent_at)

    @property
    def is_urgent(self) -> bool:
        """Whether it holds what the front end must not wait for: a request's first tokens (its time to
        first token), a request's end, or a failure."""
        return bool(self.failures) or any(d.finished or d.prompt_logprobs is not None or d.metrics
                                          for d in self.deltas)
