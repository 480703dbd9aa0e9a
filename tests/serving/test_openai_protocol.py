"""OpenAI request bodies -> SamplingParams without a server: each spelling of a structured output
(OpenAI's response_format, vLLM's structured_outputs and guided_* fields) maps to the same
StructuredOutputs, naming the request's own field for errors."""

from __future__ import annotations

import pytest

from warpspec.errors import InvalidRequestError
from warpspec.sampling_params import StructuredOutputs
from warpspec.serving.openai_protocol import chat_request, completion_request, structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("body,expected,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=SCHEMA), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True), "response_format"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputs(choice=["a", "b"]), "structured_outputs.choice"),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA), "guided_json"),
    ({"guided_grammar": "start: \"x\""}, StructuredOutputs(grammar="start: \"x\""), "guided_grammar"),
    ({"guided_choice": ["a"]}, StructuredOutputs(choice=["a"]), "guided_choice"),
])
def test_every_spelling_maps_to_one_structured_output(body, expected, field):
    spec = structured_output(body)
    assert spec == expected and spec.field == field


def test_text_format_and_no_field_mean_free_text():
    assert structured_output({"response_format": {"type": "text"}}) is None
    assert structured_output({}) is None


def test_both_endpoints_carry_it_into_the_sampling_params():
    chat = chat_request({"messages": [{"role": "user", "content": "x"}],
                         "response_format": {"type": "json_object"}}, 512)
    assert chat.params.structured_output == StructuredOutputs(json_object=True)
    request = completion_request({"prompt": "x", "guided_regex": "[a-z]"}, 512)
    assert request.params.structured_output == StructuredOutputs(regex="[a-z]")


@pytest.mark.parametrize("body,message", [
    ({"response_format": "json"}, "response_format must be an object, got str"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format.json_schema.schema is required"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice and guided_regex are alternatives"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex must be a non-empty string"),
    ({"guided_choice": "ab"}, "guided_choice must be a non-empty list of strings"),
])
def test_malformed_bodies_are_refused_naming_the_field(body, message):
    with pytest.raises(InvalidRequestError, match=message):
        structured_output(body)


@pytest.mark.parametrize("options,message", [
    ("yes", "stream_options must be an object, got str"),
    ({"include_usage": True, "per_token_usage": True},
     r"stream_options has unknown field\(s\) per_token_usage; this server knows"),
    ({"continuous_usage_stats": "yes"}, "stream_options.continuous_usage_stats must be a boolean"),
])
def test_stream_options_are_checked_not_ignored(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        completion_request({"prompt": "x", "stream": True, "stream_options": options}, 512)


ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object


def _tools(**fields):
    return chat_request({"messages": [{"role": "user", "content": "x"}], "tools": [ADD, NOW], **fields}, 512)


def test_tool_choice_required_and_named_are_grammars_of_the_json_call_form():
    call_add = {"type": "object", "properties": {"name": {"const": "add"}, "parameters": {
        **ADD["function"]["parameters"], "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False}
    call_now = {"type": "object", "properties": {"name": {"const": "now"}, "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False}
    named = _tools(tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.params.structured_output == StructuredOutputs(json=call_add)
    one = _tools(tool_choice="required", parallel_tool_calls=False)
    assert one.params.structured_output == StructuredOutputs(json={"anyOf": [call_add, call_now]})
    several = _tools(tool_choice="required").params.structured_output.json
    assert several == {"type": "array", "items": {"anyOf": [call_add, call_now]}, "minItems": 1, "maxItems": 8}
    # auto and none leave the model free; none also reads no calls out of the reply.
    for choice, parses in (("auto", True), ("none", False), (None, True)):
        chat = _tools(**({"tool_choice": choice} if choice else {}))
        assert chat.params.structured_output is None and chat.tools.parses_calls == parses
    assert chat.tools.names == {"add", "now"}
