"""What evaluation harnesses send to /v1/completions: lists of prompts, echo with logprobs (lm-eval's
loglikelihood), max_tokens 0, text offsets, vLLM's prompt_logprobs; OpenAI-shaped answers for unknown
routes, methods and models. The real app and engine run in this process; the official `openai`
client and raw JSON reach it through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import math

import httpx2 as httpx  # the HTTP library the openai client is built on
import pytest

from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.sampling_params import SamplingParams
from warpspec.serving.limits import RequestLimits
from warpspec.serving.openai_api import build_openai_app
from warpspec.serving.replica_frontend import ReplicaFrontend

openai = pytest.importorskip("openai")

# Two token-id prompts whose last tokens are a continuation: context of 5 tokens, continuation of 3.
CONTEXTS = [[1, 40, 41, 42, 43], [1, 300, 301, 7, 9]]
CONTINUATIONS = [[44, 45, 46], [10, 11, 12]]


@pytest.fixture(scope="module")
def scored(serving_checkpoint):
    """Prompt logprobs from the Python API: what HTTP must reproduce."""
    from warpspec import LLM

    with LLM(str(serving_checkpoint), dtype="float32") as llm:
        outs = llm.generate([c + x for c, x in zip(CONTEXTS, CONTINUATIONS, strict=True)],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        greedy = llm.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0, logprobs=2))[0]
    return outs, greedy


def run(serving_checkpoint, scenario, limits: RequestLimits | None = None):
    """scenario(http, client) against the app over a fresh in-process engine."""

    async def main():
        llm = AsyncLLM.from_options(str(serving_checkpoint), dtype="float32", max_model_len=512, num_kv_blocks=64)
        app = build_openai_app(ReplicaFrontend(llm, "tiny"), limits=limits)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http, \
                    openai.AsyncOpenAI(base_url="http://replica/v1", api_key="unused", max_retries=0,
                                       http_client=httpx.AsyncClient(transport=transport)) as client:
                return await scenario(http, client)
        finally:
            await llm.shutdown()

    return asyncio.run(main())


def test_lm_eval_loglikelihood_request_matches_the_python_api(serving_checkpoint, scored):
    """The exact body lm-eval's local-completions model sends for loglikelihood, and its parsing:
    sum(token_logprobs[ctxlen:-1]) and whether each continuation token was the greedy one."""
    expected, _ = scored
    body = {"model": "tiny", "prompt": [c + x for c, x in zip(CONTEXTS, CONTINUATIONS, strict=True)],
            "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}

    async def scenario(http, client):
        reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    reply = run(serving_checkpoint, scenario)
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, context, continuation, out in zip(choices, CONTEXTS, CONTINUATIONS, expected, strict=True):
        logprobs = choice["logprobs"]
        # Every prompt token, then the one generated token; nothing predicts the first prompt token.
        assert len(logprobs["token_logprobs"]) == len(context) + len(continuation) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        ctxlen = len(context)
        got = sum(logprobs["token_logprobs"][ctxlen:-1])
        want = sum(out.prompt_logprobs[p][t].logprob for p, t in enumerate(context + continuation) if p >= ctxlen)
        assert math.isclose(got, want, abs_tol=1e-4)
        is_greedy = all(lp == max(top.values()) for lp, top in
                        zip(logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1], strict=True))
        want_greedy = all(out.prompt_logprobs[p][t].rank == 1 for p, t in enumerate(context + continuation)
                          if p >= ctxlen)
        assert is_greedy == want_greedy
    assert reply["usage"]["prompt_tokens"] == sum(len(c) + len(x) for c, x in zip(CONTEXTS, CONTINUATIONS,
                                                                                   strict=True))


def test_echo_max_tokens_zero_and_offsets_with_the_openai_client(serving_checkpoint, scored):
    _, greedy = scored

    async def scenario(http, client):
        prompt_only = await client.completions.create(model="tiny", prompt="def main():", echo=True, logprobs=1,
                                                      max_tokens=0)
        plain = await client.completions.create(model="tiny", prompt="def main():", max_tokens=8, temperature=0,
                                                logprobs=2)
        echoed = await client.completions.create(model="tiny", prompt="def main():", max_tokens=8, temperature=0,
                                                 echo=True)
        many = await client.completions.create(model="tiny", prompt=["def main():", [1, 40, 41], "import os"],
                                               max_tokens=8, temperature=0)
        alone = [await client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
                 for p in ("def main():", [1, 40, 41], "import os")]
        streamed = [c async for c in await client.completions.create(
            model="tiny", prompt="def main():", max_tokens=8, temperature=0, logprobs=1, echo=True, stream=True)]
        return prompt_only, plain, echoed, many, alone, streamed

    prompt_only, plain, echoed, many, alone, streamed = run(serving_checkpoint, scenario)
    # max_tokens 0 with echo: the prompt, scored, and nothing generated.
    choice = prompt_only.choices[0]
    assert choice.text == "def main():"
    assert len(choice.logprobs.tokens) == prompt_only.usage.prompt_tokens and choice.logprobs.token_logprobs[0] is None
    # Offsets into the choice's text: each token starts where the previous one ended.
    logprobs = plain.choices[0].logprobs
    assert plain.choices[0].text == greedy.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert logprobs.token_logprobs == pytest.approx([p[t].logprob for p, t in zip(greedy.logprobs, greedy.token_ids,
                                                                                     strict=True)], abs=1e-5)
    assert echoed.choices[0].text == "def main():" + greedy.text
    # A list of prompts: one choice each, in order, as each alone; usage adds up.
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage.completion_tokens == 24
    # Streaming with echo: the prompt comes first, offsets continue across chunks.
    text = "".join(c.choices[0].text for c in streamed)
    assert text == "def main():" + greedy.text
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_vllm_prompt_logprobs_field(serving_checkpoint, scored):
    expected, _ = scored

    async def scenario(http, client):
        reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": CONTEXTS[0] + CONTINUATIONS[0],
                                                         "max_tokens": 1, "prompt_logprobs": 1})
        return reply.json()

    positions = run(serving_checkpoint, scenario)["choices"][0]["prompt_logprobs"]
    want = expected[0].prompt_logprobs
    assert positions[0] is None and len(positions) == len(want)
    for got, ref in zip(positions[1:], want[1:], strict=True):
        assert {int(t): v["rank"] for t, v in got.items()} == {t: lp.rank for t, lp in ref.items()}
        assert all(math.isclose(got[str(t)]["logprob"], lp.logprob, abs_tol=1e-5) for t, lp in ref.items())


def test_models_routes_and_methods_answer_in_openai_shape(serving_checkpoint):
    async def scenario(http, client):
        model = await client.models.retrieve("tiny")
        with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
            await client.models.retrieve("gpt-4")
        replies = [await http.get("/v1/nowhere"), await http.get("/v1/completions"),
                   await http.delete("/v1/models")]
        return model, [(r.status_code, r.json()) for r in replies]

    model, replies = run(serving_checkpoint, scenario)
    assert model.id == "tiny"
    assert [status for status, _ in replies] == [404, 405, 405]
    for status, body in replies:
        assert set(body) == {"error"} and body["error"]["code"] == status
        assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert "GET /v1/nowhere" in replies[0][1]["error"]["message"]


@pytest.mark.parametrize("fields, message", [
    ({"echo": "yes"}, "echo must be a boolean, got 'yes'"),
    ({"max_tokens": 0}, "max_tokens must be >= 1 (0 only with echo"),
    ({"prompt": ["a", ""]}, "prompt[1] is empty"),
    ({"prompt": ["a", [1, "x"]]}, "prompt[1] must be a non-empty string or list of token ids"),
    ({"prompt": ["a"] * 5}, "prompt holds 5 prompts; max_prompts_per_request is 4"),
    ({"prompt": ["a", "b"], "stream": True}, "stream takes one prompt per request, got 2"),
    ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "prompt": [5] * 600}, "600 tokens; max_model_len 512"),
    ({"prompt": ["a", [5] * 600]}, "600 tokens; max_model_len 512"),
])
def test_bad_scoring_requests_are_400_and_the_replica_stays_exact(serving_checkpoint, scored, fields, message):
    _, greedy = scored

    async def scenario(http, client):
        reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": "def main():", "max_tokens": 4,
                                                         **fields})
        after = await client.completions.create(model="tiny", prompt="def main():", max_tokens=8, temperature=0)
        return reply, after

    reply, after = run(serving_checkpoint, scenario, RequestLimits(max_prompts_per_request=4))
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert after.choices[0].text == greedy.text
