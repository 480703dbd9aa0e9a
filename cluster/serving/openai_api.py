"""The OpenAI-compatible HTTP API of one replica, as a FastAPI app over a ReplicaFrontend.

    POST /v1/completions        POST /v1/chat/completions      (stream: server-sent events)
    GET  /v1/models             GET  /v1/models/{id}           GET /health (liveness)   GET /ready
    GET  /admin/stats (KV blocks, queue)

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with 400 for bad
input (invalid JSON included), 401 for a missing or wrong API key (when the deployment has one; only
/health and /ready are open then), 404 for an unknown model or route, 405 for a wrong method, 413 for a body
over max_request_bytes, 429 when the replica's queue is full, 503 when it cannot serve. A client
that disconnects mid-stream aborts its request (Serve cancels the replica's handler, which closes the
engine stream and frees the KV blocks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from warpspec.errors import InvalidRequestError, NotFoundError
from warpspec.serving.auth import ApiKeyAuth
from warpspec.serving.chat_template import ChatTemplate
from warpspec.serving.limits import RequestLimits
from warpspec.serving.openai_protocol import (
    CompletionRequest,
    ResponseBuilder,
    chat_request,
    completion_request,
    requested_model,
    usage,
)
from warpspec.serving.replica_frontend import ReplicaFrontend
from warpspec.serving.tool_request import ToolRequest
from warpspec.serving.wire_errors import wire_error


def error_response(error: BaseException) -> JSONResponse:
    wire = wire_error(error)
    # RFC 6750: a 401 names the scheme the client should use.
    headers = {"www-authenticate": "Bearer"} if wire.http_status == 401 else None
    return _error_body(wire.message, wire.openai_type, wire.http_status, headers)


def _error_body(message: str, error_type: str, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": None, "code": status}},
                        status_code=status, headers=headers)


async def _final_output(stream):
    """Run a stream to its end; closing it on any exit aborts the request in the engine."""
    async with aclosing(stream):
        final = None
        async for out in stream:
            final = out
        return final


class EventStreamResponse(Response):
    """text/event-stream over an async iterator of events, on plain asyncio rather than Starlette's
    StreamingResponse, whose anyio task group kept the response running after Serve cancelled it
    for a client that disconnected (seen with Ray Serve 2.60, Starlette 1.10). Here the cancellation
    lands in the engine stream and the iterator is closed however the response ends, which aborts the
    engine request. (Serve's `receive` cannot tell: it reports http.disconnect as soon as the request
    body has been read.)"""

    def __init__(self, events: AsyncIterator[str]):
        # Not Response.__init__: it would announce content-length 0.
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def build_openai_app(frontend: ReplicaFrontend, chat_template: ChatTemplate | None = None, replica_id: str = "",
                     limits: RequestLimits | None = None, auth: ApiKeyAuth | None = None) -> FastAPI:
    app = FastAPI(title="warpspec", description="OpenAI-compatible API of a warpspec replica")
    template = chat_template or ChatTemplate.from_dir(frontend.description.path, frontend.tokenizer)
    model_name = frontend.description.name
    limits = limits or RequestLimits()

    def decode_token(token_id: int) -> str:
        return frontend.tokenizer.decode([token_id]) if frontend.tokenizer is not None else str(token_id)

    def answered(authorized: bool = True):
        """A route whose every failure becomes an OpenAI error body, the API key checked first unless
        not authorized (health)."""
        def wrap(route):
            @functools.wraps(route)  # FastAPI reads the route's own parameters through it
            async def handler(**params):
                try:
                    if authorized and auth is not None:
                        auth.check_header(params["request"].headers.get("authorization"))
                    return await route(**params)
                except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
                    return error_response(e)
            return handler
        return wrap

    async def read_body(request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit():  # refuse before reading what was announced
            limits.check_request_bytes(int(declared), "the request body")
        raw = await request.body()
        limits.check_request_bytes(len(raw), "the request body")
        try:
            # Python's parser takes NaN and Infinity too: the field checks then name the field.
            body = json.loads(raw)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
            raise InvalidRequestError(f"the request body is not valid JSON: {str(e)[:200]}") from None
        except RecursionError:
            raise InvalidRequestError("the request body is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        name = requested_model(body)
        if name != model_name:
            raise NotFoundError(f"model {name!r} is not served here; this deployment serves {model_name!r}")
        return body

    async def run(body: dict, request: CompletionRequest, chat: bool, headers, tools: ToolRequest | None = None):
        builder = ResponseBuilder(model_name, chat, request, decode_token, tools)
        stream_of = functools.partial(frontend.stream, trace_headers=headers,
                                      operation="chat" if chat else "text_completion")
        if not body.get("stream"):
            # A list of prompts runs side by side; the first failure cancels (and so aborts) the others
            # and is the reply's error.
            tasks = [asyncio.ensure_future(_final_output(stream_of(prompt, request.params)))
                     for prompt in request.prompts]
            try:
                outs = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            return JSONResponse(builder.final(outs))
        stream = stream_of(request.prompts[0], request.params)
        # Start the request before answering 200, so that queue-full and engine errors get a status.
        first = await anext(stream)
        stream_options = body.get("stream_options") or {}
        include_usage = bool(stream_options.get("include_usage"))
        continuous_usage = bool(stream_options.get("continuous_usage_stats"))

        async def events() -> AsyncIterator[str]:
            out = first
            try:
                while True:
                    if out.new_text or out.new_token_ids or out.finished:
                        chunk = builder.chunk(out)
                        if continuous_usage:
                            chunk["usage"] = usage(out)
                        yield _sse(chunk)
                    if out.finished:
                        break
                    out = await anext(stream)
                if include_usage:
                    yield _sse(builder.usage_chunk(out))
                yield _sse("[DONE]")
            except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
                wire = wire_error(e)
                yield _sse({"error": {"message": wire.message, "type": wire.openai_type, "code": wire.http_status}})
            finally:
                await stream.aclose()

        return EventStreamResponse(events())

    @app.post("/v1/completions")
    @answered()
    async def completions(request: Request):
        body = await read_body(request)
        return await run(body, completion_request(body, frontend.description.max_model_len, limits), chat=False,
                         headers=request.headers)

    @app.post("/v1/chat/completions")
    @answered()
    async def chat_completions(request: Request):
        body = await read_body(request)
        chat = chat_request(body, frontend.description.max_model_len, limits)
        prompt = template.render(chat.messages, chat.tools.functions if chat.tools is not None else None)
        return await run(body, CompletionRequest([prompt], chat.params), chat=True, headers=request.headers,
                         tools=chat.tools)

    @app.get("/v1/models")
    @answered()
    async def models(request: Request):
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    @answered()
    async def model(request: Request, model_id: str):
        if model_id != model_name:
            raise NotFoundError(f"model {model_id!r} is not served here; this deployment serves {model_name!r}")
        return model_card()

    def model_card() -> dict:
        d = frontend.description
        return {"id": d.name, "object": "model", "created": 0, "owned_by": "warpspec", "max_model_len": d.max_model_len}

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        """Unknown routes (404) and wrong methods (405) answer in OpenAI's shape too."""
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_body(f"{error.detail}: {request.method} {request.url.path}", kind, error.status_code,
                           dict(error.headers) if error.headers else None)

    @app.get("/health")
    @answered(authorized=False)
    async def health():
        """Liveness: 503 only when the replica cannot recover by itself."""
        frontend.check_alive()
        return {"status": "ok"}

    @app.get("/ready")
    @answered(authorized=False)
    async def ready():
        """Readiness: 503 while the replica cannot serve at once (failed, stuck, rebuilding, draining)."""
        frontend.check_health()
        return {"status": "ready"}

    @app.get("/admin/stats")
    @answered()
    async def stats(request: Request):
        snapshot = frontend.stats()
        return {**dataclasses.asdict(snapshot), "kv_cache_usage": snapshot.kv_cache_usage, "replica": replica_id}

    return app
