"""Tool calls out of generated text: Llama 4's two forms, whole or as a stream of OpenAI deltas.

A Llama 4 chat template asks for calls in one of two forms, and the parser reads both, wherever they
start (a model often writes a sentence first):

    JSON       {"name": "get_weather", "parameters": {"city": "Paris"}}
               several: a JSON list of such objects, or objects separated by ";" or new lines
    pythonic   [get_weather(city="Paris"), add(a=1, b=[2, 3])]
               optionally inside <|python_start|> ... <|python_end|>

Only the request's own tool names count as calls (a Markdown link "[a](b)" or a JSON answer that
happens to have a "name" field stays text), and a call whose text does not parse to the end leaves
the whole reply as text: nothing the model wrote is lost.

Streaming (ToolCallStream): text before a call streams as content; once a call starts, the text is
held. A JSON call sends its name as soon as the name is complete, then its arguments in pieces as
they are generated; a pythonic call is sent whole once its closing parenthesis arrives (its
arguments only become JSON then).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# Where a call may begin: a JSON object naming a function, a JSON list of them, a pythonic list.
_JSON_CALL = re.compile(r'\{\s*"(name|type)"\s*:')
_JSON_LIST = re.compile(r'\[\s*\{\s*"(name|type)"\s*:')
_PYTHONIC_CALL = re.compile(r"\[\s*([A-Za-z_][\w.-]*)\s*\(")
_SEPARATORS = re.compile(r"[\s;]*")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class ParsedReply:
    content: str | None  # the text around the calls (None when there is none)
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, tool_names: set[str]) -> ParsedReply:
    """text -> its tool calls and the text before them. No call found, or one that does not parse:
    the whole text is the content."""
    start = find_call_start(text, tool_names)
    if start is not None:
        calls = _parse_calls(text[start:], tool_names)
        if calls:
            content = text[:start].strip()
            return ParsedReply(content or None, calls)
    return ParsedReply(text or None, [])


def find_call_start(text: str, tool_names: set[str]) -> int | None:
    """Where the first call that names one of tool_names begins, or None."""
    candidates = []
    tag = text.find(PYTHON_START)
    if tag >= 0:
        candidates.append(tag)
    for pattern in (_JSON_CALL, _JSON_LIST):
        for m in pattern.finditer(text):
            if _names_a_tool(text[m.start():], tool_names):
                candidates.append(m.start())
                break
    for m in _PYTHONIC_CALL.finditer(text):
        if m.group(1) in tool_names:
            candidates.append(m.start())
            break
    return min(candidates, default=None)


def _names_a_tool(text: str, tool_names: set[str]) -> bool:
    """Does the JSON object (or list) at the start of text name a tool within its first fields?
    Checked on the prefix only: the call may still be being generated."""
    m = re.match(r'[\[\s]*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"([^"]*)"', text)
    if m is None:
        # Still too short to tell: `{"na`, `{"name": "get_w`: a prefix of some tool's call.
        partial = re.match(r'[\[\s]*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"([^"]*)$', text)
        return partial is not None and any(name.startswith(partial.group(1)) for name in tool_names)
    return m.group(1) in tool_names


def _parse_calls(text: str, tool_names: set[str]) -> list[ToolCall]:
    """The calls text holds from its start to its end (trailing space and an end tag allowed), or []."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
        return _parse_pythonic(body, tool_names) or _parse_json_calls(body, tool_names)
    if body.startswith("[") and _PYTHONIC_CALL.match(body):
        return _parse_pythonic(body, tool_names)
    return _parse_json_calls(body, tool_names)


def _parse_json_calls(text: str, tool_names: set[str]) -> list[ToolCall]:
    decoder = json.JSONDecoder()
    objects, position = [], 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return []
        objects.extend(value if isinstance(value, list) else [value])
        position = _SEPARATORS.match(text, position).end()
    calls = [_json_call(obj, tool_names) for obj in objects]
    return calls if calls and all(calls) else []


def _json_call(obj: object, tool_names: set[str]) -> ToolCall | None:
    """{"name", "parameters" | "arguments"} (or OpenAI's {"type": "function", "function": {...}}) -> a call."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    arguments = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if name not in tool_names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _parse_pythonic(text: str, tool_names: set[str]) -> list[ToolCall]:
    """[f(a=1, b="x"), g()] -> calls; arguments must be literals (numbers, strings, lists, dicts,
    True/False/None)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name | ast.Attribute):
            return []
        name = ast.unparse(node.func)
        if name not in tool_names:
            return []
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, SyntaxError):
            return []
        if len(arguments) != len(node.keywords):  # **kwargs
            return []
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


@dataclass
class ToolCallDelta:
    """One piece of one call, in the shape of OpenAI's delta.tool_calls[i]: the first piece of a
    call carries its id and name, the later ones only more of its arguments."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict:
        function: dict = {"arguments": self.arguments}
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        out["function"] = function
        return out


class ToolCallStream:
    """Feeds a reply's text as it grows; says what to send: content, and tool call deltas.

    The deltas' arguments, joined per call, are the call's arguments; the content joined is the text
    before the first call. A reply that turns out to hold no parsable call is all content by the
    end: finish() sends what was held."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.text = ""
        self.sent_content = 0  # characters of text sent as content
        self.call_start: int | None = None  # where the held call text begins
        self.num_calls = 0  # calls begun (their name sent)
        self.json_progress: _JsonCallProgress | None = None

    def feed(self, new_text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content to send, deltas to send) after new_text."""
        self.text += new_text
        if self.call_start is None:
            start = find_call_start(self.text, self.tool_names)
            if start is None:
                # Hold back what could still become a call's start ("[", "{", "<|python_st", ...).
                safe = _safe_content_end(self.text, self.sent_content)
                content, self.sent_content = self.text[self.sent_content:safe], safe
                return content, []
            content = self.text[self.sent_content:start]
            self.sent_content = start
            self.call_start = start
            return content, self._call_deltas()
        return "", self._call_deltas()

    def _call_deltas(self) -> list[ToolCallDelta]:
        held = self.text[self.call_start:]
        if _is_json_form(held):
            if self.json_progress is None:
                self.json_progress = _JsonCallProgress(self.tool_names)
            return self.json_progress.advance(held)
        # Pythonic: a call is sent once its text closes; its arguments only become JSON then.
        calls = _complete_pythonic_prefix(held, self.tool_names)
        deltas = [ToolCallDelta(self.num_calls + i, call.arguments, call.id, call.name)
                  for i, call in enumerate(calls[self.num_calls:])]
        self.num_calls = len(calls)
        return deltas

    def finish(self) -> tuple[str, bool]:
        """At the end of the reply: (content still held, whether any call was sent). Held text that
        never became a call is sent as content."""
        if self.call_start is None:
            return self.text[self.sent_content:], False
        if (self.json_progress.num_sent if self.json_progress is not None else self.num_calls):
            return "", True
        return self.text[self.sent_content:], False


# Text after a "[" or "{" is held this long while it might still turn into a call's start
# (`{"type": "function", "name": "` is 31 characters; a tool's name then counts from its prefix).
HOLD_CHARS = 48


def _safe_content_end(text: str, sent: int) -> int:
    """How much of text can be sent as content now: all but a tail that may begin a call."""
    for i in range(max(sent, len(text) - HOLD_CHARS), len(text)):
        tail = text[i:]
        if tail[0] in "[{" or (tail[0] == "<" and PYTHON_START.startswith(tail[:len(PYTHON_START)])):
            return i
    return len(text)


def _is_json_form(held: str) -> bool:
    body = held.removeprefix(PYTHON_START).lstrip()
    return body.startswith("{") or bool(_JSON_LIST.match(body))


def _complete_pythonic_prefix(held: str, tool_names: set[str]) -> list[ToolCall]:
    """The calls of a pythonic list whose text is complete so far: `[a(x=1), b(y=` -> [a]."""
    body = held.removeprefix(PYTHON_START).lstrip()
    calls: list[ToolCall] = []
    depth, in_string, quote, escaped, start = 0, False, "", False, 1
    for i, ch in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                in_string = False
            continue
        if ch in "\"'":
            in_string, quote = True, ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 1 and ch == ")":  # one call closed: parse it alone
                parsed = _parse_pythonic("[" + body[start:i + 1].strip().lstrip(",").strip() + "]", tool_names)
                if not parsed:
                    return calls
                calls.extend(parsed)
                start = i + 1
    return calls


_JSON_CALL_HEAD = re.compile(r'[\s\[;,]*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?(?:"function"\s*:\s*\{\s*)?'
                             r'"name"\s*:\s*"([^"]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


class _JsonCallProgress:
    """Streams JSON calls as they are generated: the name once `"name": "...", "parameters": ` is
    complete, then the arguments object's characters as they arrive, each call's end found by bracket
    depth (strings skipped)."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.num_sent = 0  # calls whose name was sent
        self.scan = 0  # where in the held text the next call's head is looked for
        self.args_start: int | None = None  # the current call's arguments begin here
        self.args_sent = 0  # and were sent up to here

    def advance(self, held: str) -> list[ToolCallDelta]:
        body = held.removeprefix(PYTHON_START)
        deltas: list[ToolCallDelta] = []
        while True:
            if self.args_start is None:
                m = _JSON_CALL_HEAD.match(body, self.scan)
                if m is None or m.group(1) not in self.tool_names or m.end() >= len(body):
                    return deltas
                call = ToolCall(m.group(1), "")
                deltas.append(ToolCallDelta(self.num_sent, "", call.id, call.name))
                self.num_sent += 1
                self.args_start = self.args_sent = m.end()
            end = _json_value_end(body, self.args_start)
            upto = len(body) if end is None else end
            if upto > self.args_sent:
                deltas[-1:] = _merge(deltas[-1:], ToolCallDelta(self.num_sent - 1, body[self.args_sent:upto]))
                self.args_sent = upto
            if end is None:
                return deltas
            # The call's own object closes after its arguments: the next call's head comes after it.
            close = body.find("}", end)
            if close < 0:
                return deltas
            self.scan, self.args_start = close + 1, None


def _merge(last: list[ToolCallDelta], new: ToolCallDelta) -> list[ToolCallDelta]:
    """One delta per call per feed: a name delta just sent takes the first arguments too."""
    if last and last[0].index == new.index:
        return [ToolCallDelta(new.index, last[0].arguments + new.arguments, last[0].id, last[0].name)]
    return [*last, new]


def _json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array starting at text[start] (past its closing bracket), or None
    while it is still open. A scalar argument value is not a call's shape and never ends."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
