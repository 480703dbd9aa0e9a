"""The OpenAI-compatible HTTP API end to end, with the official `openai` client (and raw HTTP for
what a client library never sends: invalid JSON)."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from typing import Literal

import jsonschema
import pydantic
import pytest

from warpspec.sampling_params import SamplingParams

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

PROMPT = "def main():"


@pytest.fixture(scope="module")
def client(serving_stack):
    with openai.OpenAI(base_url=f"{serving_stack.http_base}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def test_completions_greedy_matches_in_process_llm(client, reference_llm):
    expected = reference_llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))[0]
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0)
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12  # the include_usage chunk
    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True,
                                            extra_body={"stream_options": {"continuous_usage_stats": True}}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and chunks[0].usage.prompt_tokens == len(
        expected.prompt_token_ids)


def test_chat_completions_with_the_default_template(client, reference_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    # The documented default template (chat_template.py) for a checkpoint without one.
    prompt = "system: Be brief.\nuser: Hi!\nassistant:"
    expected = reference_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0]

    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]


def test_structured_outputs_through_the_openai_client(client):
    """The schema, not the (random) model, makes each reply parse: response_format json_schema,
    chat.completions.parse with a pydantic model, a schema streamed, and vLLM's own fields (each
    spelling's mapping is tested in test_openai_protocol.py)."""
    messages = [{"role": "user", "content": "Who?"}]
    schema = Person.model_json_schema()
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=0.0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "person", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)

    parsed = client.chat.completions.parse(model="tiny", messages=messages, max_tokens=80, temperature=0.8,
                                           seed=3, response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)

    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=0.8, seed=5,
                                            stream=True, response_format={"type": "json_schema", "json_schema": {
                                                "name": "person", "schema": schema}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), schema)

    choice = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.8, seed=1,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")
    regex = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=2,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)


def test_models_and_health(client, serving_stack):
    assert [m.id for m in client.models.list()] == ["tiny"]
    with urllib.request.urlopen(f"{serving_stack.http_base}/health", timeout=10) as reply:
        assert reply.status == 200 and json.loads(reply.read()) == {"status": "ok"}
    with urllib.request.urlopen(f"{serving_stack.http_base}/ready", timeout=10) as reply:
        assert reply.status == 200 and json.loads(reply.read()) == {"status": "ready"}


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert "'gpt-4' is not served here" in error.value.message
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4")
    assert "'gpt-4' is not served here" in error.value.message


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": -1}, "max_tokens must be >= 1"),
    ({"max_tokens": 100_000}, "max_tokens must be at most max_model_len 512"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": [5] * 600}, "600 tokens; max_model_len 512"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"n": 2}, "n must be 1"),
    ({"extra_body": {"bogus_field": 1}}, "unknown field(s) bogus_field"),
])
def test_bad_completions_are_400(client, kwargs, field):
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(**request)
    assert field in error.value.message
    with pytest.raises(openai.BadRequestError):  # streaming requests fail before the stream starts
        client.completions.create(**request, stream=True)


def test_bad_chat_messages_are_400(client):
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)


def _post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_invalid_json_is_400(serving_stack):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, body = _post(serving_stack.http_base + path, b'{"model": "tiny", "prompt": ')
        assert status == 400
        assert body["error"]["type"] == "invalid_request_error" and "not valid JSON" in body["error"]["message"]
    status, body = _post(serving_stack.http_base + "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]


# As in test_grpc_service: 480 tokens outlast ABORT_WITHIN_S, so only an abort can free the replica in time.
LONG_TOKENS = 480
ABORT_WITHIN_S = 1.0


def test_disconnect_mid_stream_aborts_the_request_at_once(client, serving_stack):
    aborted = serving_stack.wait_idle()["num_aborted"]
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LONG_TOKENS, temperature=0.0,
                                       extra_body={"ignore_eos": True}, stream=True)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()  # drops the HTTP connection
    serving_stack.wait_aborted(aborted + 1, ABORT_WITHIN_S)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0.0)
    assert reply.usage.completion_tokens == 2


def test_disconnect_while_waiting_for_a_whole_reply_aborts_at_once(client, serving_stack):
    """A non-streaming client that hangs up mid-generation (a timeout in its HTTP library): the
    request must not run on for nobody."""
    aborted = serving_stack.wait_idle()["num_aborted"]
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    host, port = serving_stack.http_base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() +
                           b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                           b"\r\n\r\n" + body)
        serving_stack.wait_running()
    serving_stack.wait_aborted(aborted + 1, ABORT_WITHIN_S)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0.0)
    assert reply.usage.completion_tokens == 2
