"""Size limits a deployment puts on what one client may send, checked at the front ends before a
request is parsed into engine types, so that a huge body costs a bounded amount of work.

The per-request sampling caps (stop strings, logprobs, max_tokens, seed) are SamplingParams' own and
hold for the Python API too; max_tokens and prompt length are also bounded by max_model_len.
"""

from __future__ import annotations

from dataclasses import dataclass

from warpspec.errors import InvalidRequestError, RequestTooLargeError

MIB = 1024 * 1024



@dataclass(frozen=True)
class RequestLimits:
    # One gRPC message or HTTP body. Token-id prompts of a 1M-token context take ~7 MiB as JSON.
    max_request_bytes: int = 16 * MIB
    # The prompt text as UTF-8 (chat: all message contents together); tokenizing it is the cost bounded here.
    max_prompt_bytes: int = 4 * MIB
    # Prompts in one /v1/completions request (each one choice, run side by side); OpenAI allows 2048.
    max_prompts_per_request: int = 256

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_bytes", "max_prompts_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check_request_bytes(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.max_request_bytes:
            raise RequestTooLargeError(f"{what} is {num_bytes} bytes; max_request_bytes is {self.max_request_bytes}")

    def check_prompt_text(self, text: str, field: str = "prompt") -> None:
        # len(text) <= bytes <= 4 * len(text): skip encoding the common small prompt.
        if len(text) * 4 <= self.max_prompt_bytes:
            return
        num_bytes = len(text.encode("utf-8", errors="surrogatepass"))
        if num_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(f"{field} is {num_bytes} bytes of UTF-8; max_prompt_bytes is "
                                      f"{self.max_prompt_bytes}")
