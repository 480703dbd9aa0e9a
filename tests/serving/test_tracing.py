"""Request traces (warpspec/tracing.py) through the replica front: one trace per request under the
client's W3C traceparent (gRPC metadata and HTTP headers), the phase spans in order with GenAI
attributes, a failed request's error, a malformed traceparent ignored, the real OTLP/HTTP exporter
posting to a receiver on loopback, and through Ray Serve the gRPC proxy's span above the replica's."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from starlette.testclient import TestClient

from helpers.private_cluster import run_on_private_cluster
from warpspec import tracing
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.errors import InvalidRequestError
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.serving.grpc_service import GenerationService
from warpspec.serving.openai_api import build_openai_app
from warpspec.serving.replica_frontend import ReplicaFrontend
from warpspec.serving.serve_config import ServeConfig
from warpspec.tracing import TRACER_NAME, configure_tracing, tracing_requested

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
PHASES = ["validate and tokenize", "queue", "prefill", "decode", "detokenize and stream"]  # the request's children
SPANS = ["prefill chunk", *PHASES]  # below the request's span, for a prompt that fits one step


def _request(max_tokens: int = 6) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="def main():", params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                             ignore_eos=True))


def _traced_frontend(checkpoint, tracer) -> ReplicaFrontend:
    llm = AsyncLLM.from_options(str(checkpoint), dtype="float32", max_model_len=128, num_kv_blocks=32,
                                max_num_batched_tokens=16)
    return ReplicaFrontend(llm, "tiny", tracer=tracer)


def _by_name(spans) -> dict:
    return {span.name: span for span in spans}


def test_a_request_is_one_trace_of_its_phases_under_the_clients_traceparent(serving_checkpoint, caplog,
                                                                             monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_warned_malformed", False)

    async def main():
        frontend = _traced_frontend(serving_checkpoint, provider.get_tracer(TRACER_NAME))
        service = GenerationService(frontend)
        reply = await service.generate(_request(), metadata=[("traceparent", TRACEPARENT)])
        traced = exporter.get_finished_spans()
        exporter.clear()
        for _ in range(2):
            await service.generate(_request(2), metadata=[("traceparent", "00-not-a-trace-01")])
        malformed = exporter.get_finished_spans()
        exporter.clear()
        too_long = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 200), params=_request().params)
        with pytest.raises(InvalidRequestError):
            await service.generate(too_long)
        failed = exporter.get_finished_spans()
        exporter.clear()
        # 40 prompt tokens in steps of 16: three chunks.
        await service.generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(3, 43))),
                                                  params=_request(2).params))
        chunked = exporter.get_finished_spans()
        await frontend.shutdown()
        return reply, traced, malformed, failed, chunked

    with caplog.at_level(logging.WARNING, logger="warpspec.tracing"):
        reply, traced, malformed, failed, chunked = asyncio.run(main())

    spans = _by_name(traced)
    assert sorted(spans) == sorted(["text_completion tiny", *SPANS])
    root = spans["text_completion tiny"]
    assert {format(s.context.trace_id, "032x") for s in traced} == {TRACE_ID}
    assert format(root.parent.span_id, "016x") == PARENT_SPAN_ID and root.parent.is_remote
    assert all(spans[name].parent.span_id == root.context.span_id for name in PHASES)
    assert spans["prefill chunk"].parent.span_id == spans["prefill"].context.span_id
    assert root.attributes["gen_ai.request.model"] == "tiny" and root.attributes["gen_ai.request.max_tokens"] == 6
    assert root.attributes["gen_ai.usage.output_tokens"] == len(reply.token_ids) == 6
    assert root.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # The phases follow each other on one timeline, inside the request's span.
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert root.start_time <= spans["validate and tokenize"].end_time <= queue.start_time
    assert queue.end_time <= prefill.start_time + 1 and prefill.end_time <= decode.start_time + 1
    assert decode.end_time <= root.end_time
    assert sum(event.attributes["warpspec.new_tokens"] for event in decode.events) == 6

    # A malformed traceparent: each request starts a trace of its own, and it is logged once.
    roots = [s for s in malformed if s.name == "text_completion tiny"]
    assert len(roots) == 2 and roots[0].parent is None and roots[0].context.trace_id != roots[1].context.trace_id
    assert [r.message for r in caplog.records].count(
        "ignored a malformed traceparent '00-not-a-trace-01': the request starts a new trace (logged once)") == 1

    # A request the front end refuses ends its trace there, marked as failed with the reason.
    spans = _by_name(failed)
    assert sorted(spans) == ["text_completion tiny", "validate and tokenize"]
    for span in spans.values():
        assert span.status.status_code == StatusCode.ERROR and "max_model_len 128" in span.status.description

    # Chunked prefill: a span per step that ran prompt tokens, in order, inside the prefill span.
    chunks = sorted((s for s in chunked if s.name == "prefill chunk"), key=lambda s: s.start_time)
    prefill = _by_name(chunked)["prefill"]
    assert [c.attributes["warpspec.prefill.tokens"] for c in chunks] == [16, 16, 8]
    assert all(earlier.end_time <= later.start_time for earlier, later in zip(chunks, chunks[1:], strict=False))
    assert prefill.start_time <= chunks[0].start_time + 1000 and chunks[-1].end_time <= prefill.end_time + 1000


def test_the_http_traceparent_header_is_honoured(serving_checkpoint):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    frontend = _traced_frontend(serving_checkpoint, provider.get_tracer(TRACER_NAME))
    with TestClient(build_openai_app(frontend)) as client:
        reply = client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                  "temperature": 0})
        assert reply.status_code == 200, reply.text
        client.portal.call(frontend.shutdown)
    spans = _by_name(exporter.get_finished_spans())
    assert sorted(spans) == sorted(["chat tiny", *SPANS])
    assert format(spans["chat tiny"].context.trace_id, "032x") == TRACE_ID
    assert spans["chat tiny"].attributes["gen_ai.operation.name"] == "chat"


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, list[bytes]]]:
    """An OTLP/HTTP receiver on loopback: (its /v1/traces URL, the bodies posted to it so far)."""
    bodies: list[bytes] = []

    class Receive(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
                bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receive)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1/traces", bodies
    finally:
        server.shutdown()
        thread.join()


def received_spans(bodies: list[bytes]) -> list[tuple[str, object]]:
    """(service.name, span) for every span in the posted ExportTraceServiceRequests."""
    spans = []
    for body in bodies:
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
    return spans


def test_spans_reach_an_otlp_http_receiver_through_the_real_exporter(serving_checkpoint):
    with otlp_receiver() as (url, bodies):
        provider = configure_tracing(url)

        async def main():
            frontend = _traced_frontend(serving_checkpoint, provider.get_tracer(TRACER_NAME))
            await GenerationService(frontend).generate(_request(3), metadata=[("traceparent", TRACEPARENT)])
            await frontend.shutdown()

        asyncio.run(main())
        provider.shutdown()  # sends what the batch still holds
    spans = received_spans(bodies)
    assert {service for service, _ in spans} == {"warpspec"}
    assert sorted(span.name for _, span in spans) == sorted(["text_completion tiny", *SPANS])
    assert {span.trace_id.hex() for _, span in spans} == {TRACE_ID}


@pytest.mark.slow
def test_through_serve_the_proxys_span_is_the_parent_of_the_replicas(serving_checkpoint):
    """A private cluster whose environment asks for traces (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): the
    gRPC proxy and the replica both export, and a request is one trace: client -> proxy -> replica."""
    with otlp_receiver() as (url, bodies):
        tracing_env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        report = run_on_private_cluster(Path(__file__).with_name("traced_stack.py"),
                                        [str(serving_checkpoint), TRACEPARENT], "the traced stack", 300, tracing_env)
        assert report == {"num_tokens": 4}
        spans = received_spans(bodies)
    by_name = {span.name: (service, span) for service, span in spans}
    assert {"warpspec.v1.Generation/GenerateStream", "text_completion tiny", *SPANS} <= set(by_name), sorted(by_name)
    proxy_service, proxy = by_name["warpspec.v1.Generation/GenerateStream"]
    replica_service, replica = by_name["text_completion tiny"]
    assert (proxy_service, replica_service) == ("warpspec-proxy", "warpspec")
    assert proxy.trace_id.hex() == replica.trace_id.hex() == TRACE_ID
    assert proxy.parent_span_id.hex() == PARENT_SPAN_ID and replica.parent_span_id == proxy.span_id


def test_tracing_is_off_unless_an_option_or_the_otel_variables_ask(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing_requested() and configure_tracing() is None
    assert tracing_requested("http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert tracing_requested()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing_requested("http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing_requested()
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http:// or https:// URL"):
        ServeConfig(model="/models/m", otlp_traces_endpoint="collector:4317")
