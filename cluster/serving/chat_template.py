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
without a template still gets a usable, documented format.
"""

from __future__ import annotations

import json
from pathlib import Path

from warpspec.core.engine_core import Prompt
from warpspec.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


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

    def render(self, messages: object) -> Prompt:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        pairs = [_message_text(i, m) for i, m in enumerate(messages)]
        if self.compiled is None:
            return "".join(f"{role}: {text}\n" for role, text in pairs) + "assistant:"
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json, so chat messages cannot be encoded")
        text = self.compiled.render(messages=[{"role": r, "content": t} for r, t in pairs],
                                    add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        return self.tokenizer.hf.encode(text, add_special_tokens=False).ids


def _raise_template_error(message: str) -> None:
    # Templates call raise_exception() to refuse conversations they cannot format (e.g. roles out of order).
    raise InvalidRequestError(f"messages: the chat template refused them: {message}")
