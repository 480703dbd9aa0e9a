"""Request traces with OpenTelemetry: one trace per request, off unless asked for.

Turned on in a served replica by the serve option `otlp_traces_endpoint`, or by the standard
variables (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT, or OTEL_TRACES_EXPORTER
naming otlp); OTEL_SDK_DISABLED=true and OTEL_TRACES_EXPORTER=none keep it off. Spans go to an
OTLP/HTTP receiver in batches (the SDK's BatchSpanProcessor, which OTEL_BSP_* tunes), and the SDK's
OTEL_TRACES_SAMPLER picks which requests are traced (default: every one).

A request's spans, named and attributed after OpenTelemetry's GenAI semantic conventions where they
apply (gen_ai.operation.name, gen_ai.request.*, gen_ai.usage.*, gen_ai.response.finish_reasons),
under the gRPC proxy's "warpspec.v1.Generation/<Method>" where the proxy traces too
(serving/grpc_servicers.py):
- "{operation} {model}": the replica front, from the request's arrival to its last message; a child
  of the client's W3C `traceparent` (gRPC metadata or HTTP header) when it sends a valid one;
- "validate and tokenize": the front end's checks and the prompt's tokens;
- "queue": waiting in the engine core for its first step;
- "prefill": from its first step to its first token (the span says how many prompt tokens came from
  the prefix cache), with a "prefill chunk" span for each step that ran prompt tokens (chunked
  prefill splits a long prompt over several);
- "decode": from the first token to the end, with an event per reply from the core: the tokens it
  brought, the steps it covers, and with a draft the drafts verified and accepted (a reply covers
  several steps when core_reply_interval_ms merges them: the counts are then their sums);
- "detokenize and stream": the text and the messages to the client, from first token to the end.
The queue, prefill and decode times come from the engine core's own clock (the request's metrics),
placed on the front end's timeline from the request's arrival.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from warpspec.outputs import RequestOutput
    from warpspec.sampling_params import SamplingParams

logger = logging.getLogger("warpspec.tracing")

TRACER_NAME = "warpspec"
_OTLP_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_warned_malformed = False


def tracing_requested(endpoint: str | None = None) -> bool:
    """Whether an option or the OTEL_ variables ask for traces to be exported."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(endpoint) or any(os.environ.get(name) for name in _OTLP_VARIABLES) or "otlp" in exporter


def configure_tracing(endpoint: str | None = None, service_name: str = "warpspec") -> TracerProvider | None:
    """A tracer provider exporting over OTLP/HTTP to endpoint (the full URL of the receiver's
    /v1/traces) or to where the OTEL_ variables say, or None when tracing is not requested. It is the
    caller's own, not the process's global one: a replica, a test and another library each keep theirs
    (provider.get_tracer(TRACER_NAME); provider.shutdown() sends what is pending)."""
    if not tracing_requested(endpoint):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
    logger.info("tracing requests to %s", endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
    return provider


def parent_context(headers: Mapping[str, str] | None):
    """The caller's trace context from W3C `traceparent` / `tracestate` headers (gRPC metadata or HTTP
    headers, names in any case), or None. A malformed traceparent is ignored, so the request starts a
    trace of its own; it is logged once per process."""
    global _warned_malformed
    if not headers:
        return None
    carrier = {name.lower(): value for name, value in headers.items()
               if name.lower() in ("traceparent", "tracestate") and isinstance(value, str)}
    if "traceparent" not in carrier:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract(carrier)
    if not trace.get_current_span(context).get_span_context().is_valid:
        if not _warned_malformed:
            _warned_malformed = True
            logger.warning("ignored a malformed traceparent %r: the request starts a new trace (logged once)",
                           carrier["traceparent"][:80])
        return None
    return context


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTrace:
    """The spans of one request (the module docstring), built as its outputs arrive."""

    def __init__(self, tracer: Tracer, operation: str, model: str, params: SamplingParams,
                 headers: Mapping[str, str] | None = None, request_id: str | None = None):
        from opentelemetry.trace import SpanKind

        self.tracer = tracer
        self.root: Span = tracer.start_span(
            f"{operation} {model}", context=parent_context(headers), kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "gen_ai.system": "warpspec",
                        "gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens,
                        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                        **({"gen_ai.request.seed": params.seed} if params.seed is not None else {}),
                        "warpspec.request.id": request_id or "", "warpspec.request.priority": params.priority})
        self.context = set_span_in_context(self.root)
        self.arrival_ns: int | None = None
        self.first_output_ns: int | None = None
        self.prefill_chunks: tuple[tuple[float, float, int], ...] = ()
        self.events: list[tuple[str, dict, int]] = []  # the decode span's, until it is made at the end

    @property
    def trace_id(self) -> str:
        return format(self.root.get_span_context().trace_id, "032x")

    @contextmanager
    def validating(self):
        """Around the front end's checks and tokenization; the request arrives when they end."""
        with self.tracer.start_as_current_span("validate and tokenize", context=self.context):
            yield
        self.arrival_ns = time.time_ns()

    def on_output(self, out: RequestOutput) -> None:
        """An output from the engine core, in order. The core's times come with the last one (its
        metrics), so the phase spans are made then."""
        now = time.time_ns()
        self.prefill_chunks += out.prefill_chunks
        if out.new_token_ids:
            if self.first_output_ns is None:
                self.first_output_ns = now
            event = {"warpspec.new_tokens": len(out.new_token_ids), "warpspec.steps": out.num_steps}
            if out.num_draft_tokens:
                event |= {"warpspec.spec.draft_tokens": out.num_draft_tokens,
                          "warpspec.spec.accepted_tokens": max(0, len(out.new_token_ids) - out.num_steps)}
            self.events.append(("speculative round" if out.num_draft_tokens else "tokens", event, now))
        if out.finished:
            self._phases(out.metrics, now)
            self._usage(out)

    def _phases(self, metrics: Mapping[str, float], now: int) -> None:
        arrival = self.arrival_ns if self.arrival_ns is not None else now
        queue_end = arrival + _ns(metrics.get("queue_time_s", 0.0))
        first_token = arrival + _ns(metrics["time_to_first_token_s"]) if "time_to_first_token_s" in metrics \
            else (self.first_output_ns or now)
        self.tracer.start_span("queue", context=self.context, start_time=arrival).end(queue_end)
        prefill = self.tracer.start_span("prefill", context=self.context, start_time=queue_end, attributes={
            "gen_ai.usage.input_tokens": int(metrics.get("prompt_tokens", 0)),
            "warpspec.cached_prompt_tokens": int(metrics.get("cached_prompt_tokens", 0))})
        prefill.end(max(queue_end, first_token))
        prefill_context = set_span_in_context(prefill)
        for start_s, end_s, num_tokens in self.prefill_chunks:
            self.tracer.start_span("prefill chunk", context=prefill_context, start_time=arrival + _ns(start_s),
                                   attributes={"warpspec.prefill.tokens": num_tokens}).end(arrival + _ns(end_s))
        decode = self.tracer.start_span("decode", context=self.context, start_time=first_token)
        for name, attributes, at in self.events:
            decode.add_event(name, attributes, at)
        decode.end(max(first_token, now))
        self.events = []
        stream_start = self.first_output_ns or now
        self.tracer.start_span("detokenize and stream", context=self.context, start_time=stream_start).end(now)

    def _usage(self, out: RequestOutput) -> None:
        metrics = out.metrics
        usage: dict[str, Any] = {"gen_ai.usage.output_tokens": len(out.token_ids),
                                 "gen_ai.response.finish_reasons": [out.finish_reason or "unknown"]}
        if "prompt_tokens" in metrics:
            usage["gen_ai.usage.input_tokens"] = int(metrics["prompt_tokens"])
        for name in ("acceptance_length", "time_to_first_token_s", "time_per_output_token_s", "queue_time_s"):
            if name in metrics:
                usage[f"warpspec.{name}"] = metrics[name]
        self.root.set_attributes(usage)

    def end(self, error: BaseException | None = None) -> None:
        """The request is over: its last message sent, or failed or abandoned (error)."""
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            self.root.record_exception(error)
            self.root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))
        self.root.end()


def set_span_in_context(span: Span):
    """A context whose current span is span (a parent for spans started under it, or to inject)."""
    from opentelemetry import trace

    return trace.set_span_in_context(span)
