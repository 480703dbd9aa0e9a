"""The bad-input matrix of the network entry points, against the one shared deployment (conftest's
serving_stack: max_model_len 512, vocabulary 512, default limits): each row is one wrong request over
gRPC or HTTP, the status it must get, and a fragment of the message naming the field. No row may get
INTERNAL / 500 or leak a traceback; afterwards the replica is healthy, holds no request or KV block,
and still answers a normal request exactly as the in-process engine does.

The Python entry points and the loader have their matrix in tests/entrypoints/test_bad_inputs_python.py."""

from __future__ import annotations

import json

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc
from warpspec.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_MODEL_LEN, VOCAB, MODEL = 512, 512, "tiny"  # conftest's stack
MIB = 1024 * 1024
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _gen(prompt="def main():", request_id="", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, request_id=request_id, params=pb.SamplingParams(**params))


def _ids(ids, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), params=pb.SamplingParams(**params))


def _raw(fields: bytes) -> bytes:
    return fields


# (name, method, request: a message or raw bytes, expected code, message fragment)
GRPC_ROWS = [
    ("missing prompt", "Generate", pb.GenerateRequest(), INVALID, "needs a prompt"),
    ("empty prompt", "Generate", _gen(""), INVALID, "prompt is empty"),
    ("0 tokens", "Generate", _ids([]), INVALID, "prompt_token_ids is empty"),
    ("max_model_len+1 tokens", "Generate", _ids([5] * (MAX_MODEL_LEN + 1)), INVALID,
     f"prompt has {MAX_MODEL_LEN + 1} tokens; max_model_len {MAX_MODEL_LEN}"),
    ("token id past vocab", "Generate", _ids([5, VOCAB]), INVALID, f"token id {VOCAB} is outside the vocabulary"),
    ("negative token id", "Generate", _ids([5, -1]), INVALID, "token id -1 is outside the vocabulary"),
    ("negative max_tokens", "Generate", _gen(max_tokens=-5), INVALID, "params.max_tokens must be >= 1"),
    ("huge max_tokens", "Generate", _gen(max_tokens=2**31 - 1), INVALID,
     "params.max_tokens must be at most max_model_len 512"),
    ("negative top_k", "Generate", _gen(top_k=-7), INVALID, "params.top_k must be >= -1"),
    ("NaN temperature", "Generate", _gen(temperature=float("nan")), INVALID, "params.temperature must be finite"),
    ("inf top_p", "Generate", _gen(top_p=float("inf")), INVALID, "params.top_p must be finite"),
    ("-inf presence_penalty", "Generate", _gen(presence_penalty=float("-inf")), INVALID,
     "params.presence_penalty must be finite"),
    ("huge seed", "Generate", _gen(seed=2**64 - 1), INVALID, "params.seed must be <="),
    ("1000 stop strings", "Generate", _gen(stop=["x"] * 1000), INVALID, "params.stop has 1000 strings; at most 64"),
    ("long stop string", "Generate", _gen(stop=["x" * 1000]), INVALID, "at most 256 characters"),
    ("1000 stop token ids", "Generate", _gen(stop_token_ids=[3] * 1000), INVALID, "params.stop_token_ids has 1000"),
    ("negative stop token id", "Generate", _gen(stop_token_ids=[-1]), INVALID, "params.stop_token_ids must be >= 0"),
    ("logprobs 21", "Generate", _gen(logprobs=21), INVALID, "params.logprobs must be at most 20"),
    ("negative logprobs", "Generate", _gen(logprobs=-1), INVALID, "params.logprobs must be >= 0"),
    ("long request_id", "Generate", _gen(request_id="r" * 1000), INVALID, "request_id must be at most 256"),
    ("prompt over max_prompt_bytes", "Generate", _gen("é" * (2 * MIB + 1)), INVALID,
     f"prompt is {4 * MIB + 2} bytes of UTF-8; max_prompt_bytes is {4 * MIB}"),
    ("message over max_request_bytes", "Generate", _gen(request_id="r" * (16 * MIB + 1)), INVALID,
     "GenerateRequest is 16777"),
    # Field 1 (prompt) as bytes that are not UTF-8: protobuf refuses the string field.
    ("non-UTF-8 prompt", "Generate", b"\x0a\x02\xff\xfe", INVALID, "GenerateRequest"),
    # Field 1 sent as a varint, not length-delimited: a malformed message.
    ("wrong wire type", "Generate", b"\x08\x05", INVALID, "GenerateRequest"),
    ("garbage bytes", "Generate", b"\xff\xff\xff\xff", INVALID, "GenerateRequest"),
    ("stream: 1000 stop strings", "GenerateStream", _gen(stop=["x"] * 1000), INVALID, "params.stop has 1000"),
    ("stream: non-UTF-8 prompt", "GenerateStream", b"\x0a\x02\xff\xfe", INVALID, "GenerateRequest"),
    ("invalid JSON schema", "Generate", _gen(structured_output=pb.StructuredOutput(json_schema='{"type": 5')),
     INVALID, "params.structured_output.json_schema is not a JSON schema"),
    ("unsupported schema keyword", "Generate",
     _gen(structured_output=pb.StructuredOutput(json_schema='{"type": "array", "uniqueItems": true}')), INVALID,
     'params.structured_output.json_schema cannot be enforced: Unimplemented keys: ["uniqueItems"]'),
    ("regex that does not compile", "Generate", _gen(structured_output=pb.StructuredOutput(regex="a(b")), INVALID,
     "params.structured_output.regex cannot be enforced"),
    ("empty structured_output", "Generate", _gen(structured_output=pb.StructuredOutput()), INVALID,
     "params.structured_output is empty"),
    ("empty choice", "Generate", _gen(structured_output=pb.StructuredOutput(choice=pb.Choices())), INVALID,
     "params.structured_output.choice must be a non-empty list"),
    ("tokenize: empty", "Tokenize", pb.TokenizeRequest(), INVALID, "text is empty"),
    ("tokenize: non-UTF-8", "Tokenize", b"\x0a\x01\xff", INVALID, "TokenizeRequest"),
    ("tokenize: over max_prompt_bytes", "Tokenize", pb.TokenizeRequest(text="x" * (4 * MIB + 1)), INVALID,
     "text is 4194305 bytes"),
]


@pytest.fixture(scope="module")
def channel(serving_stack):
    with grpc.insecure_channel(serving_stack.grpc_target) as channel:
        yield channel


def _call(channel, method: str, request):
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    path = f"/warpspec.v1.Generation/{method}"
    if method == "GenerateStream":
        return list(channel.unary_stream(path, request_serializer=lambda b: b,
                                         response_deserializer=pb.GenerateResponse.FromString)(raw, timeout=30))
    reply = {"Generate": pb.GenerateResponse, "Tokenize": pb.TokenizeResponse}[method]
    return channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=reply.FromString)(
        raw, timeout=30)


@pytest.mark.parametrize("name, method, request_, code, fragment", GRPC_ROWS, ids=[r[0] for r in GRPC_ROWS])
def test_grpc_rows(channel, name, method, request_, code, fragment):
    with pytest.raises(grpc.RpcError) as error:
        _call(channel, method, request_)
    assert error.value.code() == code, error.value.details()
    assert fragment in error.value.details()
    assert "Traceback" not in error.value.details()


def test_grpc_unknown_health_service_and_method(channel):
    with pytest.raises(grpc.RpcError) as error:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=30)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "'no.Such' is not served here" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        channel.unary_unary("/warpspec.v1.Generation/Nope")(b"", timeout=30)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "def main():", "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _tool(name: str, parameters: object = None) -> dict:
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}} if parameters is None else parameters
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


C, CHAT = "/v1/completions", "/v1/chat/completions"
# (name, path, body: a dict sent as JSON or raw bytes, HTTP status, message fragment)
HTTP_ROWS = [
    ("invalid JSON", C, b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("non-UTF-8 body", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "not valid JSON"),
    ("deeply nested JSON", C, b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    ("5000-digit integer", C, b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400,
     "not valid JSON"),
    ("body not an object", C, b"[1, 2]", 400, "must be a JSON object"),
    ("missing model", C, {"prompt": "x"}, 400, "model is required"),
    ("model not a string", C, _completion(model=5), 400, "model is required"),
    ("unknown model", C, _completion(model="gpt-4"), 404, "model 'gpt-4' is not served here"),
    ("unknown model (chat)", CHAT, _chat(model="llama"), 404, "model 'llama' is not served here"),
    ("missing prompt", C, {"model": MODEL}, 400, "prompt is required"),
    ("prompt wrong type", C, _completion(prompt=5), 400,
     "prompt is required: a string, a list of token ids, or a list of either"),
    ("empty prompt", C, _completion(prompt=""), 400, "prompt is empty"),
    ("0 tokens", C, _completion(prompt=[]), 400, "prompt is empty"),
    ("max_model_len+1 tokens", C, _completion(prompt=[5] * (MAX_MODEL_LEN + 1)), 400,
     f"prompt has {MAX_MODEL_LEN + 1} tokens; max_model_len"),
    ("token id past vocab", C, _completion(prompt=[5, 10**6]), 400, "token id 1000000 is outside the vocabulary"),
    ("huge token id", C, _completion(prompt=[5, 10**30]), 400, "is outside the vocabulary"),
    ("negative token id", C, _completion(prompt=[-1]), 400, "token id -1 is outside the vocabulary"),
    ("float token id", C, _completion(prompt=[1.5]), 400, "prompt must be a non-empty string or list of token ids"),
    ("too many prompts", C, _completion(prompt=["a"] * 257), 400,
     "prompt holds 257 prompts; max_prompts_per_request is 256"),
    ("two prompts streamed", C, _completion(prompt=["a", "b"], stream=True), 400,
     "stream takes one prompt per request"),
    ("an empty prompt of two", C, _completion(prompt=["a", []]), 400,
     "prompt[1] must be a non-empty string or list of token ids"),
    ("echo not a boolean", C, _completion(echo="yes"), 400, "echo must be a boolean, got 'yes'"),
    ("echo over max_model_len", C, _completion(echo=True, logprobs=1, max_tokens=0, prompt=[5] * (MAX_MODEL_LEN + 1)),
     400, f"prompt has {MAX_MODEL_LEN + 1} tokens; max_model_len"),
    ("echo of too many prompts", C, _completion(echo=True, logprobs=1, max_tokens=1, prompt=[[5, 6]] * 257), 400,
     "prompt holds 257 prompts; max_prompts_per_request is 256"),
    ("echo logprobs 21", C, _completion(echo=True, logprobs=21, max_tokens=0), 400, "logprobs must be at most 20"),
    ("prompt_logprobs a string", C, _completion(prompt_logprobs="1"), 400, "prompt_logprobs must be an integer"),
    ("negative prompt_logprobs", C, _completion(prompt_logprobs=-1), 400, "prompt_logprobs must be >= 0"),
    ("prompt_logprobs 21", C, _completion(prompt_logprobs=21), 400, "prompt_logprobs must be at most 20, got 21"),
    ("max_tokens 0 without echo", C, _completion(max_tokens=0), 400, "0 only with echo"),
    ("max_tokens a string", C, _completion(max_tokens="ten"), 400, "max_tokens must be an integer, got 'ten'"),
    ("max_tokens a float", C, _completion(max_tokens=1.5), 400, "max_tokens must be an integer"),
    ("max_tokens a boolean", C, _completion(max_tokens=True), 400, "max_tokens must be an integer, got True"),
    ("negative max_tokens", C, _completion(max_tokens=-1), 400, "max_tokens must be >= 1"),
    ("huge max_tokens", C, _completion(max_tokens=10**30), 400, "max_tokens must be at most max_model_len 512"),
    ("NaN temperature", C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400,
     "temperature must be finite, got nan"),
    ("Infinity top_p", C, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', 400, "top_p must be finite"),
    ("1e999 penalty", C, b'{"model": "tiny", "prompt": "x", "presence_penalty": -1e999}', 400,
     "presence_penalty must be finite"),
    ("temperature a string", C, _completion(temperature="hot"), 400, "temperature must be a number, got 'hot'"),
    ("negative temperature", C, _completion(temperature=-1), 400, "temperature must be >= 0"),
    ("huge top_k", C, _completion(top_k=10**30), 400, "top_k must be <= 2147483647"),
    ("negative seed", C, _completion(seed=-1), 400, "seed must be >= 0"),
    ("huge seed", C, _completion(seed=2**70), 400, "seed must be <="),
    ("1000 stop strings", C, _completion(stop=["x"] * 1000), 400, "stop has 1000 strings; at most 64"),
    ("long stop string", C, _completion(stop="x" * 1000), 400, "stop strings must be at most 256 characters"),
    ("stop a number", C, _completion(stop=5), 400, "stop must be a string or a list of strings"),
    ("stop of numbers", C, _completion(stop=[1, 2]), 400, "stop must be a string or a list of strings"),
    ("stop_token_ids a string", C, _completion(stop_token_ids="7"), 400, "stop_token_ids must be a list"),
    ("logprobs 21", C, _completion(logprobs=21), 400, "logprobs must be at most 20, got 21"),
    ("top_logprobs 21", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "logprobs must be at most 20, got 21"),
    ("n=2", C, _completion(n=2), 400, "n must be 1"),
    ("huge n", CHAT, _chat(n=10**9), 400, "n must be 1"),
    ("stream not a boolean", C, _completion(stream="yes"), 400, "stream must be a boolean"),
    ("unknown field", C, _completion(tools=[]), 400, "unknown field(s) tools"),
    ("prompt over max_prompt_bytes", C, _completion(prompt="x" * (4 * MIB + 1)), 400,
     f"prompt is {4 * MIB + 1} bytes of UTF-8; max_prompt_bytes is {4 * MIB}"),
    ("body over max_request_bytes", C, _completion(prompt="x", user="u" * (16 * MIB)), 413,
     "max_request_bytes is 16777216"),
    ("invalid JSON schema", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}), 400, "response_format.json_schema.schema cannot be enforced: "
     "Invalid type: strnig"),
    ("unsupported schema keyword", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), 400, 'Unimplemented keys: ["uniqueItems"]'),
    ("json_schema without a schema", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {}}), 400,
     "response_format.json_schema.schema is required"),
    ("unknown response_format", C, _completion(response_format={"type": "xml"}), 400,
     "response_format.type must be text, json_object or json_schema, got 'xml'"),
    ("regex that does not compile", C, _completion(structured_outputs={"regex": "a(b"}), 400,
     "structured_outputs.regex cannot be enforced"),
    ("guided_grammar that does not parse", C, _completion(guided_grammar="start: x\nx: y"), 400,
     "guided_grammar cannot be enforced"),
    ("two structured fields", CHAT, _chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     400, "response_format and structured_outputs are alternatives: send one"),
    ("structured_outputs with two kinds", C, _completion(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
     "structured_output takes exactly one of json, json_object, regex, choice, grammar; got regex, choice"),
    ("unknown structured_outputs field", C, _completion(structured_outputs={"xml": "a"}), 400,
     "structured_outputs has unknown field(s) xml"),
    ("messages missing", CHAT, {"model": MODEL}, 400, "messages must be a non-empty list"),
    ("messages a string", CHAT, _chat(messages="hi"), 400, "messages must be a non-empty list"),
    ("message not an object", CHAT, _chat(messages=["hi"]), 400, "messages[0] must be an object"),
    ("unknown role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("content a number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content must be a string"),
    ("image content", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0] must be a text part"),
    ("messages over max_prompt_bytes", CHAT, _chat(messages=[{"role": "user", "content": "x" * (4 * MIB + 1)}]),
     400, "messages is 4194305 bytes"),
    ("tool_choice naming no tool", CHAT, _chat(tools=[_tool("add")], tool_choice={
        "type": "function", "function": {"name": "nope"}}), 400,
     "tool_choice.function.name 'nope' is not among the tools' names (add)"),
    ("tool parameters not a schema", CHAT, _chat(tools=[_tool("add"), _tool("get", {"type": "strnig"})]), 400,
     "tools[1].function.parameters['type'] is not a valid JSON schema"),
    ("tool parameters not an object", CHAT, _chat(tools=[_tool("add", [1])]), 400,
     "tools[0].function.parameters must be a JSON schema object, got list"),
    ("tool name with spaces", CHAT, _chat(tools=[_tool("get weather")]), 400,
     "tools[0].function.name must be 1 to 64 letters"),
    ("two tools of one name", CHAT, _chat(tools=[_tool("add"), _tool("add")]), 400,
     "function names must be unique; add appear"),
    ("tool_choice without tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice needs tools"),
    ("tool_choice and response_format", CHAT, _chat(tools=[_tool("add")], tool_choice="required",
                                                    response_format={"type": "json_object"}), 400,
     "tool_choice 'required' and response_format are alternatives"),
    ("tool call arguments not JSON", CHAT, _chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]), 400,
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
]


@pytest.mark.parametrize("name, path, body, status, fragment", HTTP_ROWS, ids=[r[0] for r in HTTP_ROWS])
def test_http_rows(serving_stack, name, path, body, status, fragment):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = requests.post(serving_stack.http_base + path, data=data, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert reply.status_code == status, reply.text[:500]
    error = reply.json()["error"]
    assert fragment in error["message"]
    assert "Traceback" not in error["message"] and error["code"] == status


def test_extreme_but_valid_values_are_served(serving_stack, channel):
    """Values at the edges that must work, not fail: a tiny temperature is greedy (dividing by it
    overflowed to NaN probabilities, which failed the step for the whole batch), a huge one uniform."""
    for temperature in (1e-300, 1e-30, 1e30):
        reply = requests.post(serving_stack.http_base + C, timeout=60,
                              json=_completion(temperature=temperature, max_tokens=4, ignore_eos=True))
        assert reply.status_code == 200, reply.text[:500]
        assert reply.json()["usage"]["completion_tokens"] == 4
    reply = _call(channel, "Generate", _ids([5] * (MAX_MODEL_LEN - 1), max_tokens=1, temperature=1e-30))
    assert reply.usage.completion_tokens == 1  # max_model_len - 1 prompt tokens: the longest that fits
    # A reply larger than the proxy-to-replica channel's default limit (4 MiB): 20 echoed prompts of
    # 500 tokens with 20 logprobs each, ~450 bytes of JSON per position -> ~4.5 MB.
    prompts = [[7 + i] * 500 for i in range(20)]
    reply = requests.post(serving_stack.http_base + C, timeout=120, json=_completion(
        prompt=prompts, echo=True, logprobs=20, max_tokens=1))
    assert reply.status_code == 200, reply.text[:500]
    assert len(reply.content) > 4 * MIB
    assert [len(c["logprobs"]["token_logprobs"]) for c in reply.json()["choices"]] == [501] * 20


def test_the_replica_still_serves_after_the_matrix(serving_stack, channel, reference_llm):
    """Runs last in this module (pytest keeps file order)."""
    stats = serving_stack.wait_idle()  # nothing in flight, every KV block free
    assert stats["is_healthy"]
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    expected = reference_llm.generate(["def main():"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    reply = pb_grpc.GenerationStub(channel).Generate(_gen(max_tokens=12, temperature=0.0), timeout=60)
    assert list(reply.token_ids) == expected.token_ids and reply.text == expected.text
    http = requests.post(serving_stack.http_base + C, json=_completion(max_tokens=12, temperature=0.0), timeout=60)
    assert http.json()["choices"][0]["text"] == expected.text
