"""Tool calls over the OpenAI API, through the official client and an agent framework (LangChain's
ChatOpenAI), against the session's served tiny random checkpoint. The model is random: "required"
and a named tool_choice make the grammar write the call; "auto" shows what the prompt was (the
reply equals the in-process engine's on the documented default format)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers.agent_loop import run_two_tool_loop
from warpspec import SamplingParams

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(serving_stack):
    with openai.OpenAI(base_url=f"{serving_stack.http_base}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def _valid_calls(message) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


def test_a_named_tool_choice_is_called_with_valid_arguments_whole_and_streamed(client):
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0,
                  tool_choice={"type": "function", "function": {"name": "add"}})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = _valid_calls(choice.message)
    assert call[0] == "add" and choice.message.tool_calls[0].id.startswith("call_")

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pieces = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == "add"
    assert all(p.index == 0 and p.function.name is None for p in pieces[1:])
    assert json.loads("".join(p.function.arguments for p in pieces)) == call[1]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_one_of_the_tools(client, parallel):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=160, temperature=0.0)
    calls = _valid_calls(reply.choices[0].message)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert 1 <= len(calls) <= (8 if parallel else 1) and {name for name, _ in calls} <= {"get_weather", "add"}


def test_auto_and_none_prompt_with_the_tools_in_the_default_format(client, reference_llm):
    """The prompt lists the tools, the assistant's call and the tool's result as chat_template.py
    documents; the random model then writes text, which is the reply's content."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'}]
    functions = [t["function"] for t in TOOLS]
    prompt = (f"tools: {json.dumps(functions)}\nuser: Weather in Oslo?\n"
              'assistant: {"name": "get_weather", "parameters": {"city": "Oslo"}}\ntool: {"celsius": 3}\nassistant:')
    expected = reference_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice=choice,
                                               max_tokens=10, temperature=0.0)
        assert reply.choices[0].message.content == expected.text and not reply.choices[0].message.tool_calls
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_an_agent_frameworks_two_tool_loop(serving_stack):
    run_two_tool_loop(f"{serving_stack.http_base}/v1", "tiny")
