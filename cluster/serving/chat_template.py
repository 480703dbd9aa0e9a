"""Chat messages -> one prompt, with the checkpoint's own chat template when it ships one.

The template is the `chat_template` of tokenizer_config.json (a Jinja string, or a list of named
templates of which "default" is used), rendered as transformers' apply_chat_template does: a
sandboxed Jinja environment with trim_blocks/lstrip_blocks, `messages`, `add_generation_prompt=True`,
`bos_token`, `eos_token` and `raise_exception`; the rendered text is tokenized WITHOUT adding special
tokens (templates write their own BOS).

Without a template the DEFAULT applies, one line per message and an open assistant turn:

    system: You are terse.
    user: Hi!
    assistant:

tokenized like any prompt (the tokenizer adds its BOS). Plain and model-agnostic, so a checkpoint
without a template still gets a usable, documented format. With tools, a first line lists their
functions as JSON, an assistant's tool calls are written in the JSON form tool_parser.py reads (one
object, or a list of several), and a tool's result is a `tool:` line:

    tools: [{"name": "get_weather", "description": "...", "parameters": {...}}]
    user: Weather in Paris?
    assistant: {"name": "get_weather", "parameters": {"city": "Paris"}}
    tool: {"temperature": 21}
    assistant:

A template is given the tools as transformers gives them (`tools`, each {"type": "function",
"function": {...}}) and the messages with their tool_calls (arguments as objects, as templates
expect, not OpenAI's JSON text) and tool_call_id.
"""

from __future__ import annotations

import json
from pathlib import Path

from warpspec.core.engine_core import Prompt
from warpspec.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(index: int, message: object) -> dict:
    """messages[index] as a template reads it: role, content as one string, and an assistant's
    tool_calls (arguments parsed) or a tool's tool_call_id."""
    role, content = _message_text(index, message)
    out = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(index, message["tool_calls"])
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = str(message["tool_call_id"])
    return out


def _tool_calls(index: int, calls: object) -> list[dict]:
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f'{where}[{j}] must be {{"id", "type": "function", "function": '
                                      '{"name", "arguments"}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise InvalidRequestError(f"{where}[{j}].function.arguments is not valid JSON") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _message_text(index: int, message: object) -> tuple[str, str]:
    """(role, text) of messages[index]; content is a string or a list of text parts."""
    if not isinstance(message, dict):
        raise InvalidRequestError(f"messages[{index}] must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{index}].content[{j}] must be a text part "
                                          "({'type': 'text', 'text': ...}); this model reads text only")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts")
    return role, content


def _token_text(value: object) -> str:
    """tokenizer_config.json spells special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, tokenizer, template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.tokenizer = tokenizer
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.compiled = None
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self.compiled = env.from_string(template)

    @classmethod
    def from_dir(cls, model_dir: str | Path, tokenizer) -> ChatTemplate:
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return cls(tokenizer)
        config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(tokenizer, template if isinstance(template, str) else None,
                   _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: object, tools: list[dict] | None = None) -> Prompt:
        """tools: the request's functions (ToolRequest.functions), or None."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        turns = [_message(i, m) for i, m in enumerate(messages)]
        if self.compiled is None:
            lines = [f"tools: {json.dumps(tools, ensure_ascii=False)}\n"] if tools else []
            lines += [f"{t['role']}: {_default_text(t)}\n" for t in turns]
            return "".join(lines) + "assistant:"
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json, so chat messages cannot be encoded")
        extra = {"tools": [{"type": "function", "function": f} for f in tools]} if tools else {}
        text = self.compiled.render(messages=turns, add_generation_prompt=True, bos_token=self.bos_token,
                                    eos_token=self.eos_token, **extra)
        return self.tokenizer.hf.encode(text, add_special_tokens=False).ids


def _default_text(turn: dict) -> str:
    """A turn's text in the default format: an assistant's tool calls follow its content as JSON."""
    calls = [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]}
             for c in turn.get("tool_calls", ())]
    if not calls:
        return turn["content"]
    written = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
    return f"{turn['content']} {written}" if turn["content"] else written


def _raise_template_error(message: str) -> None:
    # Templates call raise_exception() to refuse conversations they cannot format (e.g. roles out of order).
    raise InvalidRequestError(f"messages: the chat template refused them: {message}")
