"""OpenAI-compatible request bodies -> (prompt, SamplingParams), and engine outputs -> the response
and stream-chunk objects of /v1/completions and /v1/chat/completions.

Fields follow the OpenAI API, plus vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, skip_special_tokens, prompt_logprobs, priority) and warpspec's speculation (false: no
drafts for this request). Structured outputs come as OpenAI's response_format (json_object, or json_schema), or
as vLLM's structured_outputs object (json, regex, choice, grammar) or its older guided_json /
guided_regex / guided_choice / guided_grammar fields; one of these per request. Chat takes tools,
tool_choice and parallel_tool_calls (tool_request.py checks them and makes the grammar of a required
call; tool_parser.py reads calls out of the reply). A field the server does not know is refused with
400 naming it, rather than silently ignored; fields clients send by habit and that change nothing
here (user, a null logit_bias, n=1, ...) are accepted.

/v1/completions also takes what evaluation harnesses send: a list of prompts (one choice each, in
order, with its index), and `echo` with `logprobs`, which returns the prompt's own tokens with their
logprobs ahead of the completion's (the first prompt token has none); `max_tokens` 0 with echo
scores the prompt alone, as lm-eval's loglikelihood requests do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from warpspec.core.engine_core import Prompt
from warpspec.errors import InvalidRequestError
from warpspec.outputs import RequestOutput, new_positions
from warpspec.sampling_params import SamplingParams, StructuredOutputs
from warpspec.serving.limits import RequestLimits
from warpspec.serving.request_mapping import check_max_tokens
from warpspec.serving.tool_parser import ToolCallStream, parse_tool_calls
from warpspec.serving.tool_request import ToolRequest, tool_request

# Request field -> SamplingParams field, common to both endpoints.
_SAMPLING_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "seed": "seed", "stop": "stop", "stop_token_ids": "stop_token_ids",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
                    "skip_special_tokens": "skip_special_tokens", "speculation": "speculation",
                    "priority": "priority"}
# Accepted and without effect here (each only at the value that means "nothing special").
_INERT_FIELDS = {"model", "stream", "stream_options", "user", "n", "best_of", "logit_bias", "suffix",
                 "service_tier", "store", "metadata"}
# include_usage: a last chunk with the usage (OpenAI); continuous_usage_stats: the usage so far in
# every chunk (vLLM).
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
# vLLM's older spelling of structured_outputs: field -> StructuredOutputs field.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = {"response_format", "structured_outputs", *_GUIDED_FIELDS}
_COMPLETION_FIELDS = (set(_SAMPLING_FIELDS) | _INERT_FIELDS | _STRUCTURED_FIELDS
                      | {"prompt", "logprobs", "echo", "prompt_logprobs"})
_CHAT_FIELDS = (set(_SAMPLING_FIELDS) | _INERT_FIELDS | _STRUCTURED_FIELDS
                | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                   "parallel_tool_calls"})


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}; this server does not support them")
    if body.get("n", 1) not in (1, None):
        raise InvalidRequestError(f"n must be 1 (one choice per request), got {body['n']!r}")
    if body.get("best_of", 1) not in (1, None):
        raise InvalidRequestError(f"best_of must be 1, got {body['best_of']!r}")
    if body.get("logit_bias"):
        raise InvalidRequestError("logit_bias is not supported")
    if body.get("suffix"):
        raise InvalidRequestError("suffix is not supported")
    if not isinstance(body.get("stream", False), bool | None):
        raise InvalidRequestError(f"stream must be a boolean, got {body['stream']!r}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequestError(f"stream_options must be an object, got {type(options).__name__}")
        unknown = sorted(set(options) - _STREAM_OPTIONS)
        if unknown:
            raise InvalidRequestError(f"stream_options has unknown field(s) {', '.join(unknown)}; this server "
                                      f"knows {', '.join(sorted(_STREAM_OPTIONS))}")
        for name, value in options.items():
            if not isinstance(value, bool | None):
                raise InvalidRequestError(f"stream_options.{name} must be a boolean, got {value!r:.80}")


def structured_output(body: dict) -> StructuredOutputs | None:
    """The request's structured output, from whichever of its spellings it came in, each error naming
    the request's own field."""
    given = sorted(name for name in _STRUCTURED_FIELDS if body.get(name) is not None)
    if len(given) > 1:
        raise InvalidRequestError(f"{' and '.join(given)} are alternatives: send one")
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name in _GUIDED_FIELDS:
        return StructuredOutputs(**{_GUIDED_FIELDS[name]: value}, field_name=name)
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be an object, got {type(value).__name__}")
    if name == "structured_outputs":
        unknown = sorted(set(value) - {"json", "json_object", "regex", "choice", "grammar"})
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown field(s) {', '.join(unknown)}")
        kinds = [kind for kind, v in value.items() if v not in (None, False)]
        return StructuredOutputs(**value, field_name=f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else None)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, field_name="response_format")
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r:.80}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidRequestError("response_format.json_schema.schema is required: the JSON schema, an object")
    return StructuredOutputs(json=spec["schema"], field_name="response_format.json_schema.schema")


def _sampling_params(body: dict, max_model_len: int, **extra: Any) -> SamplingParams:
    kwargs = {field: body[name] for name, field in _SAMPLING_FIELDS.items() if body.get(name) is not None}
    kwargs.update(extra)
    kwargs["structured_output"] = structured_output(body)
    if isinstance(kwargs.get("stop"), list) and not all(isinstance(s, str) for s in kwargs["stop"]):
        raise InvalidRequestError("stop must be a string or a list of strings")
    check_max_tokens(kwargs.get("max_tokens"), max_model_len)
    return SamplingParams(**kwargs)


def requested_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model is required (see GET /v1/models)")
    return model


@dataclass
class CompletionRequest:
    prompts: list[Prompt]  # one choice each
    params: SamplingParams
    echo: bool = False  # the reply starts with the prompt (and its logprobs, when logprobs are asked for)
    # max_tokens 0 (with echo): the prompt alone is scored. The engine still samples one token,
    # which the reply leaves out.
    prompt_only: bool = False
    return_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field: each choice carries them


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _prompt_list(prompt: object, limits: RequestLimits) -> list[Prompt]:
    """A string, token ids, or a non-empty list of either -> the prompts, each checked by name."""
    if isinstance(prompt, list) and not prompt:
        raise InvalidRequestError("prompt is empty")
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        prompts = prompt  # a list of prompts
    elif isinstance(prompt, str | list):
        prompts = [prompt]  # one prompt: text, or token ids (checked below)
    else:
        raise InvalidRequestError("prompt is required: a string, a list of token ids, or a list of either")
    if len(prompts) > limits.max_prompts_per_request:
        raise InvalidRequestError(f"prompt holds {len(prompts)} prompts; max_prompts_per_request is "
                                  f"{limits.max_prompts_per_request}")
    for i, one in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            if not one:
                raise InvalidRequestError(f"{name} is empty")
            limits.check_prompt_text(one, name)
        elif not one or not all(map(_is_token_id, one)):
            raise InvalidRequestError(f"{name} must be a non-empty string or list of token ids")
    return prompts


def completion_request(body: dict, max_model_len: int, limits: RequestLimits | None = None) -> CompletionRequest:
    _check_fields(body, _COMPLETION_FIELDS)
    limits = limits or RequestLimits()
    prompts = _prompt_list(body.get("prompt"), limits)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise InvalidRequestError(f"echo must be a boolean, got {echo!r}")
    if len(prompts) > 1 and body.get("stream"):
        raise InvalidRequestError(f"stream takes one prompt per request, got {len(prompts)}")
    body = dict(body)
    prompt_only = type(body.get("max_tokens")) is int and body["max_tokens"] == 0  # not False, not 0.0
    if prompt_only:
        if not echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo, to score the prompt alone)")
        body["max_tokens"] = 1
    extra = {name: body[name] for name in ("logprobs", "prompt_logprobs") if body.get(name) is not None}
    params = _sampling_params(body, max_model_len, **extra)
    if echo and params.logprobs is not None:  # the echoed prompt's logprobs, as many per position as asked
        params = replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, params.logprobs))
    return CompletionRequest(prompts, params, echo, prompt_only, body.get("prompt_logprobs") is not None)


@dataclass
class ChatRequest:
    messages: object  # the deployment's ChatTemplate checks them, naming what is malformed
    params: SamplingParams
    tools: ToolRequest | None = None


def chat_request(body: dict, max_model_len: int, limits: RequestLimits | None = None) -> ChatRequest:
    _check_fields(body, _CHAT_FIELDS)
    (limits or RequestLimits()).check_prompt_text("".join(_message_texts(body.get("messages"))), "messages")
    body = dict(body)
    if body.get("max_completion_tokens") is not None:
        body.setdefault("max_tokens", body["max_completion_tokens"])
    extra = {}
    if body.get("logprobs"):
        extra["logprobs"] = body.get("top_logprobs") or 0
    tools = tool_request(body)
    params = _sampling_params(body, max_model_len, **extra)
    enforced = tools.structured_output() if tools is not None else None
    if enforced is not None:
        if params.structured_output is not None:
            raise InvalidRequestError(f"tool_choice {tools.choice!r} and {params.structured_output.field} are "
                                      "alternatives: a reply is either the tool call or the structured output")
        params = replace(params, structured_output=enforced)
    return ChatRequest(body.get("messages"), params, tools)


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


def _completion_logprobs(token_ids: list[int], positions: list | None, num_top: int,
                         decode: Callable[[int], str], text_offset: int = 0) -> tuple[dict | None, int]:
    """OpenAI's legacy logprobs object, and the offset after its last token. positions[i] is token
    i's {token id: Logprob}, or None where nothing predicts it (an echoed prompt's first token).
    text_offset: where the first token starts in the choice's text; each later one starts where the
    previous token's text ends (as in vLLM)."""
    if positions is None:
        return None, text_offset
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, position in zip(token_ids, positions, strict=True):
        chosen = position[token] if position is not None else None
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(token)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        # The num_top most likely tokens, and the chosen one (which may rank anywhere).
        top_logprobs.append(None if position is None else {
            lp.decoded_token if lp.decoded_token is not None else decode(tid): lp.logprob
            for tid, lp in position.items() if lp.rank <= num_top or tid == token})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, text_offset


def _vllm_prompt_logprobs(positions: list | None) -> list | None:
    """vLLM's spelling of prompt_logprobs: per prompt position None or {token id: {logprob, rank,
    decoded_token}}."""
    if positions is None:
        return None
    return [None if position is None else {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                                                      "decoded_token": lp.decoded_token}
                                           for tid, lp in position.items()} for position in positions]


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
    """The ids, timestamps and shapes of one request's response objects. decode: a token id's text as
    it appears in the text (a BOS the tokenizer added: ""), for echoed prompt tokens without a logprob
    entry to carry it."""

    def __init__(self, model: str, chat: bool, request: CompletionRequest | None = None,
                 decode: Callable[[int], str] = str, tools: ToolRequest | None = None):
        self.model, self.chat, self.decode = model, chat, decode
        self.request = request or CompletionRequest([], SamplingParams())
        # Chat with tools: calls are read out of the reply, whole or as it streams.
        self.tools = tools if tools is not None and tools.parses_calls else None
        self.tool_stream = ToolCallStream(self.tools.names) if self.tools is not None else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sent_first = False
        self.text_offset = 0  # streaming: where the next chunk's first token starts in the choice's text

    def _header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, outs: list[RequestOutput]) -> dict:
        """The whole reply: one choice per output, in prompt order."""
        if self.chat:
            out = outs[0]
            message: dict = {"role": "assistant", "content": out.text}
            finish_reason = _finish_reason(out)
            if self.tools is not None:
                parsed = parse_tool_calls(out.text, self.tools.names)
                if parsed.tool_calls:
                    message = {"role": "assistant", "content": parsed.content, "tool_calls": [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in parsed.tool_calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices = [{"index": 0, "message": message, "logprobs": _chat_logprobs(out.token_ids, out.logprobs),
                        "finish_reason": finish_reason}]
        else:
            choices = [self._completion_choice(i, out, out.token_ids, out.text, out.logprobs, first=True, text_offset=0)
                       for i, out in enumerate(outs)]
        usages = [usage(out) for out in outs]
        total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                               for u in usages)}
        return {**self._header("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": total}

    def _completion_choice(self, index: int, out: RequestOutput, token_ids: list[int], text: str,
                           positions: list | None, first: bool, text_offset: int) -> dict:
        """first: this choice (or chunk) is the first of its request, where an echoed prompt goes."""
        request = self.request
        if request.prompt_only:  # the one token sampled to finish the request is not part of the reply
            token_ids, text, positions = [], "", None if positions is None else []
        if request.echo and first:
            prompt = out.prompt if isinstance(out.prompt, str) else "".join(map(self.decode, out.prompt_token_ids))
            text = prompt + text
            if positions is not None:
                token_ids, positions = out.prompt_token_ids + token_ids, out.prompt_logprobs + positions
        logprobs, self.text_offset = _completion_logprobs(token_ids, positions, request.params.logprobs or 0,
                                                          self.decode, text_offset)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish_reason(out)}
        if request.return_prompt_logprobs:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_logprobs) if first else None
        return choice

    def chunk(self, out: RequestOutput) -> dict:
        positions = None
        if out.logprobs is not None:
            positions = new_positions(out)
        if self.chat:
            delta: dict = {"content": out.new_text}
            finish_reason = _finish_reason(out)
            if self.tool_stream is not None:
                delta["content"], calls = self.tool_stream.feed(out.new_text)
                if calls:
                    delta["tool_calls"] = [c.as_openai() for c in calls]
                if out.finished:
                    rest, called = self.tool_stream.finish()
                    delta["content"] += rest
                    if called and finish_reason == "stop":
                        finish_reason = "tool_calls"
            if not self.sent_first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(out.new_token_ids, positions or None),
                      "finish_reason": finish_reason}
        else:
            choice = self._completion_choice(0, out, out.new_token_ids, out.new_text, positions,
                                             first=not self.sent_first, text_offset=self.text_offset)
        self.sent_first = True
        return {**self._header("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, out: RequestOutput) -> dict:
        return {**self._header("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(out)}
