"""What a finished (or, streaming, a progressing) request hands back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float  # natural log
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position: token id -> Logprob, holding the top-k and the token actually there.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (eos, stop token or string), "length", or None while running
    logprobs: list[PositionLogprobs] | None = None
    # Position 0 has nothing before it to predict it, so prompt_logprobs[0] is None.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
