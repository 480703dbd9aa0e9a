"""OpenAI-compatible request bodies -> (prompt, SamplingParams), and engine outputs -> the response
and stream-chunk objects of /v1/completions and /v1/chat/completions.

Fields follow the OpenAI API, plus vLLM's sampling extras (top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, skip_special_tokens). A field the server does not know is refused with
400 naming it, rather than silently ignored; fields clients send by habit and that change nothing
here (user, a null logit_bias, n=1, ...) are accepted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from warpspec.engine import Prompt
from warpspec.outputs import RequestOutput
from warpspec.sampling_params import InvalidRequestError, SamplingParams
from warpspec.serving.limits import RequestLimits
from warpspec.serving.request_mapping import check_max_tokens

# Request field -> SamplingParams field, common to both endpoints.
_SAMPLING_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "seed": "seed", "stop": "stop", "stop_token_ids": "stop_token_ids",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
                    "skip_special_tokens": "skip_special_tokens"}
# Accepted and without effect here (each only at the value that means "nothing special").
_INERT_FIELDS = {"model", "stream", "stream_options", "user", "n", "best_of", "echo", "logit_bias", "suffix",
                 "service_tier", "store", "metadata", "parallel_tool_calls"}
_COMPLETION_FIELDS = set(_SAMPLING_FIELDS) | _INERT_FIELDS | {"prompt", "logprobs"}
_CHAT_FIELDS = (set(_SAMPLING_FIELDS) | _INERT_FIELDS
                | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"})


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}; this server does not support them")
    if body.get("n", 1) not in (1, None):
        raise InvalidRequestError(f"n must be 1 (one choice per request), got {body['n']!r}")
    if body.get("best_of", 1) not in (1, None):
        raise InvalidRequestError(f"best_of must be 1, got {body['best_of']!r}")
    if body.get("echo"):
        raise InvalidRequestError("echo is not supported")
    if body.get("logit_bias"):
        raise InvalidRequestError("logit_bias is not supported")
    if body.get("suffix"):
        raise InvalidRequestError("suffix is not supported")
    if not isinstance(body.get("stream", False), bool | None):
        raise InvalidRequestError(f"stream must be a boolean, got {body['stream']!r}")


def _sampling_params(body: dict, max_model_len: int, **extra: Any) -> SamplingParams:
    kwargs = {field: body[name] for name, field in _SAMPLING_FIELDS.items() if body.get(name) is not None}
    kwargs.update(extra)
    if isinstance(kwargs.get("stop"), list) and not all(isinstance(s, str) for s in kwargs["stop"]):
        raise InvalidRequestError("stop must be a string or a list of strings")
    check_max_tokens(kwargs.get("max_tokens"), max_model_len)
    return SamplingParams(**kwargs)


def requested_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model is required (see GET /v1/models)")
    return model


def completion_request(body: dict, max_model_len: int,
                       limits: RequestLimits | None = None) -> tuple[Prompt, SamplingParams]:
    _check_fields(body, _COMPLETION_FIELDS)
    limits = limits or RequestLimits()
    prompt = body.get("prompt")
    # One prompt per request: a string, token ids, or a one-element list of either.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        limits.check_prompt_text(prompt)
    elif isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt must be a non-empty string or list of token ids (one prompt per request)")
    else:
        raise InvalidRequestError("prompt is required: a string or a list of token ids")
    logprobs = body.get("logprobs")
    return prompt, _sampling_params(body, max_model_len, **({"logprobs": logprobs} if logprobs is not None else {}))


def chat_request(body: dict, max_model_len: int,
                 limits: RequestLimits | None = None) -> tuple[object, SamplingParams]:
    """(messages, params); the deployment's ChatTemplate turns the messages into the prompt (and
    refuses malformed messages, naming them)."""
    _check_fields(body, _CHAT_FIELDS)
    (limits or RequestLimits()).check_prompt_text("".join(_message_texts(body.get("messages"))), "messages")
    body = dict(body)
    if body.get("max_completion_tokens") is not None:
        body.setdefault("max_tokens", body["max_completion_tokens"])
    extra = {}
    if body.get("logprobs"):
        extra["logprobs"] = body.get("top_logprobs") or 0
    return body.get("messages"), _sampling_params(body, max_model_len, **extra)


def _message_texts(messages: object) -> list[str]:
    """The text contents of well-formed messages (string or text parts), to size them up."""
    texts: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return texts


def _finish_reason(out: RequestOutput) -> str | None:
    # OpenAI knows "stop" and "length"; an aborted request has no client left to tell.
    return None if out.finish_reason is None else ("length" if out.finish_reason == "length" else "stop")


def usage(out: RequestOutput) -> dict:
    m = out.metrics
    prompt, completion = int(m.get("prompt_tokens", len(out.prompt_token_ids))), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(m.get("cached_prompt_tokens", 0))}}


def _completion_logprobs(token_ids: list[int], positions: list | None) -> dict | None:
    if positions is None:
        return None
    pairs = list(zip(positions, token_ids, strict=False))
    return {"tokens": [pos[t].decoded_token or "" for pos, t in pairs],
            "token_logprobs": [pos[t].logprob for pos, t in pairs],
            "top_logprobs": [{lp.decoded_token or str(tid): lp.logprob for tid, lp in pos.items()} for pos, _ in pairs],
            "text_offset": []}


def _chat_logprobs(token_ids: list[int], positions: list | None) -> dict | None:
    if positions is None:
        return None
    content = []
    for pos, token in zip(positions, token_ids, strict=False):
        chosen = pos[token]
        text = chosen.decoded_token or ""
        # A position holds the top k plus the chosen token; the chosen one belongs to top_logprobs only
        # when it ranks within k.
        k = len(pos) if chosen.rank <= len(pos) else len(pos) - 1
        top = sorted((lp for lp in pos.values() if lp.rank <= k), key=lambda lp: lp.rank)
        content.append({"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                          "bytes": list((lp.decoded_token or "").encode())} for lp in top]})
    return {"content": content}


class ResponseBuilder:
    """The ids, timestamps and shapes of one request's response objects."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sent_role = False

    def final(self, out: RequestOutput) -> dict:
        positions = out.logprobs
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": _chat_logprobs(out.token_ids, positions), "finish_reason": _finish_reason(out)}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": _completion_logprobs(out.token_ids, positions),
                      "finish_reason": _finish_reason(out)}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage(out)}

    def chunk(self, out: RequestOutput) -> dict:
        positions = None
        if out.logprobs is not None and out.new_token_ids:
            positions = out.logprobs[len(out.logprobs) - len(out.new_token_ids):]
        if self.chat:
            delta: dict = {"content": out.new_text}
            if not self.sent_role:
                delta["role"], self.sent_role = "assistant", True
            choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(out.new_token_ids, positions),
                      "finish_reason": _finish_reason(out)}
        else:
            choice = {"index": 0, "text": out.new_text,
                      "logprobs": _completion_logprobs(out.new_token_ids, positions),
                      "finish_reason": _finish_reason(out)}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, out: RequestOutput) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage(out)}
