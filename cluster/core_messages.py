"""What crosses between the front end and the engine core. In: the requests added and aborted
(CoreInput), sent fire-and-forget whenever the replica has some. Out: one RequestDelta per request
that gained tokens or finished in a step; with Ray workers, one StepReply per core step carries them
on one long-lived Ray stream.

A delta carries token ids, the core's finish reason (an eos or stop token, a length limit), the
requested logprobs and, once, what a request needs at its start (prompt logprobs, the metrics known
at the first token) or end (metrics): no text and nothing of vocabulary or hidden size. The front
end detokenizes, checks stop strings and builds full RequestOutputs (output_processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from warpspec.engine_stats import EngineStats
from warpspec.errors import StepFailedError
from warpspec.outputs import PositionLogprobs
from warpspec.requests import NewRequest
from warpspec.spec_stats import SpeculationStats


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepReply:
    """What the core sends after each step, or after applying messages that ran no step (an abort
    of the last request: the replica then sees its blocks free)."""
    deltas: list[RequestDelta]
    stats: EngineStats  # after the step
    spec_stats: SpeculationStats
    failures: list[StepFailedError] = field(default_factory=list)  # requests the core dropped, and why
    sent_at: float = 0.0  # time.monotonic() in the core: a stream lag, comparable on the same node only
