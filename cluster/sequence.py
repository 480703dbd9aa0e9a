"""A request's state inside the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from warpspec.outputs import PositionLogprobs, RequestOutput
from warpspec.sampling_params import SamplingParams
from warpspec.tokenizer import IncrementalDetokenizer


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose keys/values are in the KV cache
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.finish_time = time.perf_counter()

    def to_output(self) -> RequestOutput:
        metrics: dict[str, float] = {}
        if self.first_token_time is not None:
            metrics["time_to_first_token_s"] = self.first_token_time - self.arrival_time
        if self.finish_time is not None and self.first_token_time is not None and len(self.output_token_ids) > 1:
            metrics["time_per_output_token_s"] = (self.finish_time - self.first_token_time) / (
                len(self.output_token_ids) - 1
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            stop_reason=self.stop_reason,
            metrics=metrics,
        )
