"""A replica's logs (serving/logs.py) in both formats: one JSON object per line with the request's ids
on every line logged for it, an access line per request with its status, counts and times, and never
the API key or the prompt's text."""

from __future__ import annotations

import io
import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from starlette.testclient import TestClient

from warpspec import tracing
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.serving.auth import ApiKeyAuth
from warpspec.serving.logs import configure_logging
from warpspec.serving.openai_api import build_openai_app
from warpspec.serving.replica_frontend import ReplicaFrontend
from warpspec.serving.serve_config import ServeConfig
from warpspec.tracing import TRACER_NAME

KEY = "sk-test-9f2d41c07be3"
PROMPT = "the launch codes are 7351 and this sentence is private"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def logs():
    """The "warpspec" logger's handler, writing to a buffer; taken off again afterwards."""
    def configure(log_format: str) -> io.StringIO:
        handler = configure_logging(log_format)
        buffer = io.StringIO()
        handler.setStream(buffer)
        made.append(handler)
        return buffer

    made: list[logging.Handler] = []
    yield configure
    root = logging.getLogger("warpspec")
    for handler in made:
        root.removeHandler(handler)
    root.setLevel(logging.NOTSET)


def _app(checkpoint):
    llm = AsyncLLM.from_options(str(checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=32)
    frontend = ReplicaFrontend(llm, "tiny", tracer=TracerProvider().get_tracer(TRACER_NAME))
    return frontend, build_openai_app(frontend, auth=ApiKeyAuth.from_key(KEY))


def test_json_lines_carry_the_request_ids_and_an_access_line_and_no_secret(serving_checkpoint, logs, monkeypatch):
    monkeypatch.setattr(tracing, "_warned_malformed", False)  # logged once per process
    buffer = logs("json")
    frontend, app = _app(serving_checkpoint)
    headers = {"Authorization": f"Bearer {KEY}", "traceparent": "00-not-a-trace-01"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0}
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", headers=headers, json=chat).status_code == 200
        traced = {**headers, "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
        assert client.post("/v1/chat/completions", headers=traced, json=chat).status_code == 200
        too_long = {"model": "tiny", "prompt": [5] * 200, "max_tokens": 2}
        assert client.post("/v1/completions", headers=headers, json=too_long).status_code == 400
        client.portal.call(frontend.shutdown)
    text = buffer.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    assert lines and all({"time", "level", "name", "message"} <= line.keys() for line in lines)

    access = [line for line in lines if line["name"] == "warpspec.access"]
    assert [line["status"] for line in access] == ["ok", "ok", "INVALID_ARGUMENT"]
    first, second, refused = access
    assert first["finish_reason"] == "length" and first["completion_tokens"] == 3 and first["prompt_tokens"] > 0
    assert first["time_to_first_token_s"] > 0 and first["time_per_output_token_s"] > 0
    assert second["trace_id"] == TRACE_ID and first["trace_id"] and first["trace_id"] != TRACE_ID
    assert len({line["request_id"] for line in access}) == 3 and refused["completion_tokens"] == 0
    # A line logged while serving a request carries its ids: the malformed traceparent's warning.
    (warning,) = [line for line in lines if "malformed traceparent" in line["message"]]
    assert warning["request_id"] == first["request_id"]
    # Neither the key nor the prompt's text appears anywhere, nor any piece of the prompt.
    assert KEY not in text and "launch codes" not in text and "7351" not in text


def test_text_lines_name_the_request_and_bad_formats_are_refused(serving_checkpoint, logs):
    buffer = logs("text")
    frontend, app = _app(serving_checkpoint)
    with TestClient(app) as client:
        reply = client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200
        client.portal.call(frontend.shutdown)
    (line,) = [line for line in buffer.getvalue().splitlines() if "warpspec.access" in line]
    assert " INFO warpspec.access [" in line and "]: ok: " in line and "+ 2 completion tokens, TTFT " in line
    assert line.endswith("finish length") and KEY not in buffer.getvalue() and "launch codes" not in buffer.getvalue()
    with pytest.raises(ValueError, match="log_format must be one of text, json, got 'xml'"):
        ServeConfig(model="/models/m", log_format="xml")
    with pytest.raises(ValueError, match="log_format must be one of text, json, got 'yaml'"):
        configure_logging("yaml")
