"""What an agent needs, from `warpspec serve` on the bundled pair with its EAGLE-3 draft, through the
official openai client and LangChain: JSON that validates against its schema on every one of 50
prompts (the same text the in-process engine writes without the draft), and a two-tool loop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests

from helpers.agent_loop import run_two_tool_loop
from warpspec import LLM, SamplingParams
from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_texts
from warpspec.sampling_params import StructuredOutputs
from warpspec.serving.chat_template import ChatTemplate
from warpspec.serving.serve_cli import free_local_port
from warpspec.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "kind": {"enum": ["kernel", "python", "other"]},
    "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["topic", "kind", "keywords", "score"], "additionalProperties": False}
ASKS = ("Summarise this as JSON:", "What is this about?", "Classify the text.", "Give keywords for:")
# Deterministic: each request's tokens are those it gets alone, whatever ran beside it, so the served
# replies (batched, with the draft) and the in-process ones (batched otherwise, no draft) can be compared.
ENGINE = {"dtype": "float32", "deterministic": True, "max_model_len": 512}


def _messages() -> list[list[dict]]:
    texts = held_out_texts()
    return [[{"role": "user", "content": f"{ask} {text}"}] for ask in ASKS for text in texts][:50]


@pytest.fixture(scope="module")
def served():
    """`warpspec serve` on the bundled pair with the draft, its own local Ray cluster; the HTTP base."""
    http_port, run_dir = free_local_port(), tempfile.mkdtemp(prefix="ws-agents-")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    args = [arg for name, value in ENGINE.items() for arg in ("--arg", f"{name}={str(value).lower()}")]
    process = subprocess.Popen([sys.executable, "-m", "warpspec.cli.main", "serve", "--model", str(BUNDLED_TARGET),
                                "--draft", str(BUNDLED_DRAFT), "--model-name", "tiny-maverick",
                                "--grpc-port", str(free_local_port()), "--http-port", str(http_port),
                                "--arg", f"run_dir={run_dir}", *args],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, line = time.monotonic() + 240, ""
        while "warpspec: serving" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "warpspec serve exited early"
            assert time.monotonic() < deadline, "warpspec serve did not start within 240 s"
        yield f"http://127.0.0.1:{http_port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_json_schema_replies_validate_on_50_prompts_with_the_draft_as_without(served):
    messages = _messages()
    assert len(messages) == 50
    with openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        def ask(conversation: list[dict]):
            return client.chat.completions.create(
                model="tiny-maverick", messages=conversation, max_tokens=120, temperature=0.0,
                response_format={"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA}})

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, messages))
    # The draft proposed under the grammar and was accepted (the tests' 20 in-process requests: 2.80).
    assert requests.get(f"{served}/admin/stats", timeout=30).json()["constrained_acceptance_length"] > 1.5
    served_texts = [r.choices[0].message.content for r in replies]
    for reply, text in zip(replies, served_texts, strict=True):
        assert reply.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)

    # The same requests in process, without the draft: the same JSON, token for token.
    template = ChatTemplate.from_dir(BUNDLED_TARGET, Tokenizer.from_dir(BUNDLED_TARGET))
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_output=StructuredOutputs(json=SCHEMA))
    with LLM(str(BUNDLED_TARGET), **ENGINE) as llm:
        outs = llm.generate([template.render(m) for m in messages], params)
    assert [o.text for o in outs] == served_texts


def test_an_agent_frameworks_two_tool_loop_on_the_bundled_pair(served):
    run_two_tool_loop(f"{served}/v1", "tiny-maverick")
