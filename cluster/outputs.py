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
    # "stop" (eos, stop token or string), "length", "abort", or None while running
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None
    # Position 0 has nothing before it to predict it, so prompt_logprobs[0] is None.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # On the final output: prompt/completion/cached token counts, queue time, TTFT, TPOT.
    metrics: dict[str, float] = field(default_factory=dict)
    # Streaming: what this output adds to the previous one of the same request.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # The engine steps this output covers and the drafts they verified (0 without speculation).
    num_steps: int = 0
    num_draft_tokens: int = 0
    # On the first output: the steps that ran the prompt, as (start, end) seconds since arrival and tokens.
    prefill_chunks: tuple[tuple[float, float, int], ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def new_positions(out: RequestOutput) -> list[PositionLogprobs]:
    """The logprobs of out.new_token_ids. Counted from out.token_ids, not from the end of out.logprobs:
    the front end (entrypoints/output_processor.py) appends to that list as it goes, so a consumer that reads an
    output a step or two late would find later positions at its end."""
    end = len(out.token_ids)
    return out.logprobs[end - len(out.new_token_ids): end]
