"""What crosses between the replica and the engine core in the coordinator. In: the requests added
and aborted (CoreInput), sent fire-and-forget whenever the replica has some. Out: one StepReply per
core step, on one long-lived Ray stream, carrying each request's new tokens.

A reply carries token ids, the new text, the requested logprobs and, once, what a request needs at
its start (prompt logprobs) or end (full text, metrics): nothing of vocabulary or hidden size. The
replica rebuilds full RequestOutputs from these deltas (remote_engine.OutputAssembler).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from warpspec.engine_stats import EngineStats
from warpspec.errors import StepFailedError
from warpspec.outputs import PositionLogprobs, RequestOutput
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
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[PositionLogprobs] | None = None  # one per new token, when requested
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the request's first delta
    text: str | None = None  # the whole text, on the last delta (a stop string may cut streamed text)
    metrics: dict[str, float] = field(default_factory=dict)  # on the last delta

    @classmethod
    def of(cls, out: RequestOutput) -> RequestDelta:
        """The part of an engine output the replica has not seen yet."""
        is_first = len(out.token_ids) == len(out.new_token_ids)
        num_new = len(out.new_token_ids)
        return cls(out.request_id, out.new_token_ids, out.new_text, out.finish_reason, out.stop_reason,
                   None if out.logprobs is None else out.logprobs[len(out.logprobs) - num_new:],
                   out.prompt_logprobs if is_first else None,
                   out.text if out.finished else None, out.metrics)


@dataclass
class StepReply:
    """What the core sends after each step, or after applying messages that ran no step (an abort
    of the last request: the replica then sees its blocks free)."""
    deltas: list[RequestDelta]
    stats: EngineStats  # after the step
    spec_stats: SpeculationStats
    failures: list[StepFailedError] = field(default_factory=list)  # requests the core dropped, and why
    sent_at: float = 0.0  # time.monotonic() in the core: a stream lag, comparable on the same node only
