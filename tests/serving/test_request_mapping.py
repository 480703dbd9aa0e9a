"""Network messages -> engine types without a server: proto `optional` semantics, field-named errors,
and the OpenAI request shapes (plus the chat template and Serve args they depend on)."""

from __future__ import annotations

import json
import re

import pytest

from warpspec.errors import InvalidRequestError
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.sampling_params import SamplingParams
from warpspec.serving.chat_template import ChatTemplate
from warpspec.serving.openai_protocol import chat_request, completion_request
from warpspec.serving.request_mapping import request_from_proto
from warpspec.serving.serve_config import ServeConfig


def test_unset_proto_fields_keep_engine_defaults_and_set_zero_is_kept():
    prompt, params = request_from_proto(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(top_k=0)), 64)
    defaults = SamplingParams()
    assert prompt == "x"
    assert (params.max_tokens, params.temperature, params.top_p) == (defaults.max_tokens, defaults.temperature, 1.0)
    assert params.top_k == 0 and params.seed is None and params.logprobs is None
    # temperature 0 (greedy) is not "unset"; 32-bit floats come back as the client wrote them.
    _, params = request_from_proto(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(
        temperature=0.0, top_p=0.9, stop=["\n"], seed=7)), 64)
    assert (params.temperature, params.top_p, params.stop, params.seed) == (0.0, 0.9, ["\n"], 7)


def test_a_request_opts_out_of_speculation_over_grpc_and_http():
    """speculation: unset lets the engine's draft length policy decide; false never drafts for it."""
    _, params = request_from_proto(pb.GenerateRequest(prompt="x", params=pb.SamplingParams()), 64)
    assert params.speculation is None
    _, params = request_from_proto(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(speculation=False)), 64)
    assert params.speculation is False
    assert completion_request({"model": "m", "prompt": "a", "speculation": False}, 64).params.speculation is False
    chat = chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "speculation": True}, 64)
    assert chat.params.speculation is True
    with pytest.raises(InvalidRequestError, match="speculation must be true, false or null, got 'off'"):
        completion_request({"model": "m", "prompt": "a", "speculation": "off"}, 64)


def test_a_requests_priority_over_grpc_and_http_and_its_bad_values():
    assert request_from_proto(pb.GenerateRequest(prompt="x"), 64)[1].priority == 0
    _, params = request_from_proto(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(priority=-3)), 64)
    assert params.priority == -3
    assert completion_request({"model": "m", "prompt": "a", "priority": 7}, 64).params.priority == 7
    chat = chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": -1}, 64)
    assert chat.params.priority == -1
    for value, message in [("high", "priority must be an integer, got 'high'"),
                           (1.5, "priority must be an integer, got 1.5"), (True, "priority must be an integer"),
                           (2**31, "priority must be <= 2147483647, got 2147483648"),
                           (-(2**31) - 1, "priority must be >= -2147483648, got -2147483649")]:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            completion_request({"model": "m", "prompt": "a", "priority": value}, 64)
    with pytest.raises(ValueError):  # gRPC: the int32 field itself refuses it, on the client
        pb.SamplingParams(priority=2**31)


def test_token_id_prompts_and_errors_name_the_field():
    prompt, _ = request_from_proto(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3])), 64)
    assert prompt == [1, 2, 3]
    with pytest.raises(InvalidRequestError, match="params.top_k must be >= -1"):
        request_from_proto(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(top_k=-2)), 64)
    with pytest.raises(InvalidRequestError, match="params.max_tokens must be at most max_model_len 64"):
        request_from_proto(pb.GenerateRequest(prompt="x", params=pb.SamplingParams(max_tokens=65)), 64)


def test_openai_completion_and_chat_bodies():
    request = completion_request({"model": "m", "prompt": ["hi"], "max_tokens": 3, "stop": "\n",
                                  "user": "u", "n": 1, "top_k": 5}, 64)
    params = request.params
    assert request.prompts == ["hi"] and (params.max_tokens, params.stop, params.top_k) == (3, ["\n"], 5)
    assert completion_request({"model": "m", "prompt": [[1, 2]]}, 64).prompts == [[1, 2]]
    assert completion_request({"model": "m", "prompt": [1, 2]}, 64).prompts == [[1, 2]]
    assert completion_request({"model": "m", "prompt": ["a", [3]]}, 64).prompts == ["a", [3]]
    # echo with logprobs asks the engine for the prompt's logprobs; max_tokens 0 scores the prompt alone.
    request = completion_request({"model": "m", "prompt": "a", "echo": True, "logprobs": 2, "max_tokens": 0}, 64)
    assert (request.echo, request.prompt_only, request.params.prompt_logprobs, request.params.max_tokens) == (
        True, True, 2, 1)
    chat = chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                         "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2}, 64)
    assert chat.messages[0]["content"] == "x" and (chat.params.max_tokens, chat.params.logprobs) == (5, 2)
    assert chat.tools is None
    with pytest.raises(InvalidRequestError, match="unknown field"):
        chat_request({"model": "m", "messages": [], "functions": []}, 64)


def test_chat_template_from_tokenizer_config(tmp_path, serving_checkpoint):
    from warpspec.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(serving_checkpoint)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert ChatTemplate.from_dir(tmp_path, tokenizer).render(messages) == "user: Hi\nassistant:"

    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<|begin_of_text|>"}}))
    ids = ChatTemplate.from_dir(tmp_path, tokenizer).render(messages)
    # The template writes its own BOS, so none is added on top.
    assert ids == tokenizer.hf.encode("<|begin_of_text|><user>Hi<assistant>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[1] != 1

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('roles must alternate') }}"}))
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        ChatTemplate.from_dir(tmp_path, tokenizer).render(messages)


def test_a_template_gets_the_tools_and_the_calls_arguments_as_objects(tmp_path, serving_checkpoint):
    """As a Llama 4 template reads them: `tools` as transformers passes them, an assistant's
    tool_calls with arguments as objects (OpenAI sends JSON text), a tool result's tool_call_id."""
    from warpspec.tokenizer import Tokenizer

    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = Tokenizer.from_dir(serving_checkpoint)
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3C"}]
    ids = ChatTemplate.from_dir(tmp_path, tokenizer).render(messages, [{"name": "weather", "parameters": {}}])
    expected = "[weather]<user>Oslo?<assistant>weather(Oslo)<tool>3C#c1"
    assert tokenizer.hf.decode(ids, skip_special_tokens=False) == expected


def test_serve_args_convert_strings_and_name_unknown_args():
    config = ServeConfig.from_args({"model": "/m", "num_workers": "2", "max_replicas": "3",
                                    "target_ongoing_requests": "4", "warmup": "false", "draft": "null"})
    assert config.engine == {"num_workers": 2} and not config.warmup
    assert config.autoscaling_config["max_replicas"] == 3 and config.autoscaling_config["target_ongoing_requests"] == 4
    with pytest.raises(ValueError, match="unknown arg 'num_worker'"):
        ServeConfig.from_args({"model": "/m", "num_worker": 2})
    with pytest.raises(ValueError, match="num_workers must be int, got 'two'"):
        ServeConfig.from_args({"model": "/m", "num_workers": "two"})
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        ServeConfig.from_args({"model": "/m", "min_replicas": 3, "max_replicas": 2})
    assert ServeConfig.from_args({"model": "/m", "deterministic": "true"}).engine == {"deterministic": True}
    with pytest.raises(ValueError, match="deterministic must be a boolean, got 'maybe'"):
        ServeConfig.from_args({"model": "/m", "deterministic": "maybe"})
