"""Tool calls out of text (serving/tool_parser.py): Llama 4's JSON and pythonic forms, whole and
streamed in pieces of every size."""

from __future__ import annotations

import json

import pytest

from warpspec.serving.tool_parser import ToolCallStream, parse_tool_calls

TOOLS = {"get_weather", "add", "search"}


def calls_of(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    parsed = parse_tool_calls(text, TOOLS)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    # OpenAI's own shape and "arguments", as some templates write them.
    ('{"type": "function", "name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('Let me check. {"name": "get_weather", "parameters": {"city": "Oslo"}}', "Let me check.",
     [("get_weather", {"city": "Oslo"})]),
    # Several: a list, ";" and new lines between objects.
    ('[{"name": "add", "parameters": {"a": 1}}, {"name": "search", "parameters": {"q": "x"}}]', None,
     [("add", {"a": 1}), ("search", {"q": "x"})]),
    ('{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}\n'
     '{"name": "add", "parameters": {"a": 3}}', None, [("add", {"a": 1}), ("add", {"a": 2}), ("add", {"a": 3})]),
    # Nested arguments, braces and brackets inside strings.
    ('{"name": "search", "parameters": {"q": "a}]b", "filters": {"tags": ["x", {"y": [1, 2]}]}}}', None,
     [("search", {"q": "a}]b", "filters": {"tags": ["x", {"y": [1, 2]}]}})]),
    ('[get_weather(city="Paris")]', None, [("get_weather", {"city": "Paris"})]),
    ('Sure: [get_weather(city="Paris, France"), add(a=1, b=[2, 3], opts={"x": None, "y": True})]', "Sure:",
     [("get_weather", {"city": "Paris, France"}), ("add", {"a": 1, "b": [2, 3], "opts": {"x": None, "y": True}})]),
    ('<|python_start|>[search(q="tea")]<|python_end|>', None, [("search", {"q": "tea"})]),
])
def test_both_forms_with_text_before_nested_arguments_and_several_calls(text, content, calls):
    assert calls_of(text) == (content, calls)


@pytest.mark.parametrize("text", [
    "See [the docs](https://example.com) for more.",  # a Markdown link is no call
    '{"name": "Ada", "age": 36}',  # a JSON answer whose "name" is no tool
    '[unknown_tool(a=1)]',
    '{"name": "add", "parameters": {"a": 1}',  # cut off: no closing brace
    '[add(a=1), add(b=]',
    '[add(a=open("x"))]',  # arguments must be literals
    '{"name": "add", "parameters": {"a": 1}} and then some words',
])
def test_what_is_not_a_whole_call_stays_text(text):
    assert calls_of(text) == (text, [])


def stream(text: str, piece: int) -> tuple[str, dict[int, dict]]:
    """Feed text piece characters at a time; (content sent, per call index: id, name, arguments joined)."""
    s = ToolCallStream(TOOLS)
    content, calls = "", {}
    for i in range(0, len(text), piece):
        sent, deltas = s.feed(text[i:i + piece])
        content += sent
        for d in deltas:
            call = d.as_openai()
            if "id" in call:
                assert call["index"] not in calls and call["type"] == "function"
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    rest, any_call = s.finish()
    assert any_call == bool(calls)
    return content + rest, calls


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [
    'Let me check. {"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '[{"name": "add", "parameters": {"a": 1}}, {"name": "search", "parameters": {"q": "a}]b", "n": [1, {"x": 2}]}}]',
    'Sure: [get_weather(city="Paris, France"), add(a=1, b=[2, 3])]',
    '<|python_start|>[search(q="tea")]<|python_end|>',
])
def test_streamed_pieces_join_to_the_whole_parse(text, piece):
    content, calls = stream(text, piece)
    whole = parse_tool_calls(text, TOOLS)
    assert (content.strip() or None) == whole.content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]


def test_json_arguments_stream_in_pieces_as_they_are_generated():
    s = ToolCallStream(TOOLS)
    _, deltas = s.feed('{"name": "search", "parameters": {"q": "long')
    assert [d.name for d in deltas] == ["search"] and deltas[0].arguments == '{"q": "long'
    _, deltas = s.feed(' query"}')
    assert [(d.name, d.arguments) for d in deltas] == [(None, ' query"}')]
    _, deltas = s.feed("}")
    assert deltas == [] and s.finish() == ("", True)


@pytest.mark.parametrize("piece", [1, 4, 1000])
@pytest.mark.parametrize("text", [
    "Plain words, {braces} and [brackets](links) only.",
    '{"name": "Ada", "age": 36}',
    '{"name": "get_weather", "parameters": {"city": "Os',  # cut off by max_tokens: its name was sent
])
def test_text_without_a_call_streams_whole(text, piece):
    content, calls = stream(text, piece)
    if calls:  # the cut-off call: its name and the arguments so far went out as a call
        assert content == "" and calls[0]["name"] == "get_weather"
    else:
        assert content == text
