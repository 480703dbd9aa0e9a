"""API keys on both front ends, safe defaults of `warpspec serve`, and what a client can never make the
server do (unpickle, evaluate, reach outside a chat template's sandbox).

The keyed deployment is a second Serve application ("secure", under /secure) next to the shared one,
on the same proxies: gRPC calls name it with the `application` metadata Serve routes by."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from warpspec.errors import UnauthenticatedError
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc
from warpspec.serving.auth import API_KEY_ENV, ApiKeyAuth, resolve_api_key
from warpspec.serving.chat_template import ChatTemplate
from warpspec.serving.serve_config import ServeConfig
from warpspec.tokenizer import Tokenizer

openai = pytest.importorskip("openai")

MODEL_NAME = "tiny"
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 64}  # as conftest's shared stack
KEY = "sk-test-0123456789abcdef"
APP = "secure"
ROOT = Path(__file__).resolve().parents[2]


# ---- in-process: key resolution, comparison, config, CLI defaults ------------------------------------

def test_api_key_resolution(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n")
    assert resolve_api_key(None, None, environ={}) is None  # no key anywhere: open
    assert resolve_api_key(None, None, environ={API_KEY_ENV: KEY}) == KEY
    assert resolve_api_key("flag", None, environ={API_KEY_ENV: KEY}) == "flag"  # the flag wins over the env
    assert resolve_api_key(None, str(key_file), environ={}) == KEY  # trailing newline stripped
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("flag", str(key_file))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="api_key_file .* is empty"):
        resolve_api_key(None, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="api_key_file .* cannot be read"):
        resolve_api_key(None, str(tmp_path / "missing"))


def test_api_key_check():
    auth = ApiKeyAuth.from_key(KEY)
    assert KEY.encode() not in repr(auth).encode()  # only the digest is held (and shipped to replicas)
    auth.check_header(f"Bearer {KEY}")
    auth.check_header(f"bearer {KEY} ")  # the scheme is case-insensitive
    auth.check_metadata([("application", APP), ("authorization", f"Bearer {KEY}")])
    for header, message in [(None, "requires an API key"), ("", "requires an API key"),
                            (KEY, "must be `Bearer <key>`"), (f"Basic {KEY}", "must be `Bearer <key>`"),
                            ("Bearer ", "must be `Bearer <key>`"), (f"Bearer {KEY}x", "invalid API key"),
                            (f"Bearer {KEY[:-1]}", "invalid API key")]:
        with pytest.raises(UnauthenticatedError, match=message):
            auth.check_header(header)
    with pytest.raises(UnauthenticatedError, match="requires an API key"):
        auth.check_metadata([("authorisation", f"Bearer {KEY}")])


def test_serve_config_carries_the_key_but_never_shows_it(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert ServeConfig.from_args({"model": "/m"}).auth is None
    config = ServeConfig.from_args({"model": "/m", "api_key": KEY, "max_request_bytes": "1024"})
    assert config.auth == ApiKeyAuth.from_key(KEY) and KEY not in repr(config)
    assert config.limits.max_request_bytes == 1024
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServeConfig.from_args({"model": "/m"}).auth == ApiKeyAuth.from_key("from-env")
    with pytest.raises(ValueError, match="max_request_bytes must be a positive integer"):
        ServeConfig.from_args({"model": "/m", "max_request_bytes": 0})


def test_serve_cli_defaults_are_local_and_dashboard_free():
    import argparse

    from warpspec.serving.serve_cli import add_serve_parser, start_serving

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve", "--model", "/m"])
    assert ns.host == "127.0.0.1" and ns.dashboard is False and ns.api_key is None
    assert start_serving.__defaults__[2] == "127.0.0.1"  # host
    ns = parser.parse_args(["serve", "--model", "/m", "--host", "0.0.0.0", "--dashboard", "--api-key", KEY])
    assert (ns.host, ns.dashboard, ns.api_key) == ("0.0.0.0", True, KEY)


def test_nothing_from_a_client_is_unpickled_or_evaluated():
    """A guard against regressions: the serving path has no deserializer that runs code."""
    sources = list((ROOT / "cluster" / "serving").glob("*.py")) + [ROOT / "cluster" / "sampling_params.py"]
    pattern = re.compile(r"\b(pickle|cloudpickle|marshal|shelve)\b|\beval\(|\bexec\(|yaml\.load\(|\.from_string\(")
    offenders = {p.name: m.group(0) for p in sources for m in [pattern.search(p.read_text())] if m}
    # The one template compiled is the checkpoint's own, in the sandbox (the test below). The router
    # unpickles what Serve's proxy pickled in the same process: its wrapper around a parsed gRPC
    # message (a client's bytes only ever reach protobuf's parser), as the replica itself does.
    assert offenders == {"chat_template.py": ".from_string(", "prefix_router.py": "pickle"}


def test_chat_templates_render_in_a_sandbox(serving_checkpoint):
    from jinja2.exceptions import SecurityError

    tokenizer = Tokenizer.from_dir(serving_checkpoint)
    messages = [{"role": "user", "content": "{{ 7 * 7 }}{% for x in range(3) %}x{% endfor %}"}]
    # A client's text is data to the template, never template source.
    plain = ChatTemplate(tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tokenizer.decode(plain.render(messages)) == messages[0]["content"]
    # A template (a checkpoint is not always trusted) cannot reach Python internals or mutate its inputs.
    for source in ["{{ messages.__class__.__mro__[1].__subclasses__() }}",
                   "{{ ''.__class__.__base__.__subclasses__() }}",
                   "{% set _ = messages.append({'role': 'system', 'content': 'x'}) %}"]:
        with pytest.raises(SecurityError, match="unsafe"):
            ChatTemplate(tokenizer, source).render(messages)
    # An unsafe attribute merely printed is undefined: nothing leaks (a plain Environment prints the
    # function's module globals here).
    assert ChatTemplate(tokenizer, "{{ raise_exception.__globals__ }}").render(messages) == []


# ---- over the network: a deployment with an API key ---------------------------------------------------

@pytest.fixture(scope="module")
def secure(serving_stack):
    from ray import serve

    from warpspec.serving.app import build_app

    args = {"model": str(serving_stack.model_path), "model_name": MODEL_NAME, "api_key": KEY, **ENGINE_ARGS}
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        yield serving_stack.grpc_target, f"{serving_stack.http_base}/{APP}"
    finally:
        serve.delete(APP)


def _stub(target: str):
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.GenerationStub(channel)


def _metadata(key: str | None) -> list[tuple[str, str]]:
    return [("application", APP)] + ([("authorization", f"Bearer {key}")] if key is not None else [])


@pytest.mark.slow
def test_http_requires_the_key(secure):
    _, base = secure
    with openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert [m.id for m in client.models.list()] == [MODEL_NAME]
    with openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, stream=True)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    reply = requests.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                          timeout=30)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert reply.json()["error"]["type"] == "authentication_error"
    assert requests.get(f"{base}/admin/stats", timeout=30).status_code == 401
    assert requests.get(f"{base}/health", timeout=30).status_code == 200  # probes carry no key
    assert requests.get(f"{base}/ready", timeout=30).status_code == 200
    stats = requests.get(f"{base}/admin/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert stats.json()["is_healthy"]


@pytest.mark.slow
def test_grpc_requires_the_key(secure):
    target, _ = secure
    channel, stub = _stub(target)
    with channel:
        request = pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=2))
        assert stub.Generate(request, metadata=_metadata(KEY), timeout=30).usage.completion_tokens == 2
        calls = {"Generate": lambda md: stub.Generate(request, metadata=md, timeout=30),
                 "GenerateStream": lambda md: list(stub.GenerateStream(request, metadata=md, timeout=30)),
                 "Tokenize": lambda md: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md, timeout=30),
                 "GetModelInfo": lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30)}
        for name, call in calls.items():
            for key, message in [(None, "requires an API key"), ("wrong", "invalid API key")]:
                with pytest.raises(grpc.RpcError) as error:
                    call(_metadata(key))
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert message in error.value.details(), name
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=_metadata(KEY), timeout=30).model == MODEL_NAME
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), metadata=[("application", APP)], timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
def test_refused_requests_are_never_queued(secure):
    """An unauthenticated request must not reach the engine. Observable: its prompt never entered the
    prefix cache, so the first authenticated request with that prompt finds nothing cached (and the
    second, the control, does)."""
    target, base = secure
    prompt = [(7 * i + 3) % 500 + 5 for i in range(64)]  # 4 full KV blocks, unlike any other test's prompt
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY}"}
    channel, stub = _stub(target)
    with channel, requests.Session() as http:
        before = http.get(f"{base}/admin/stats", headers=headers, timeout=30).json()
        for _ in range(3):
            assert http.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 401
            assert http.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"},
                             timeout=30).status_code == 401
            request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                         params=pb.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as error:
                stub.Generate(request, metadata=_metadata("nope"), timeout=30)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        after = http.get(f"{base}/admin/stats", headers=headers, timeout=30).json()
        assert (after["num_in_flight"], after["num_waiting"], after["num_running"]) == (0, 0, 0)
        assert after["num_aborted"] == before["num_aborted"]
        assert after["num_free_kv_blocks"] == after["num_kv_blocks"]
        first = stub.Generate(request, metadata=_metadata(KEY), timeout=30)
        second = stub.Generate(request, metadata=_metadata(KEY), timeout=30)
        assert first.usage.cached_tokens == 0
        assert second.usage.cached_tokens >= 48  # the control: the cache does keep served prompts
