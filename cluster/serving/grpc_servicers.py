"""The warpspec.v1.Generation servicer function Serve's gRPC proxy registers (serve_config's
GRPC_SERVICER_FUNCTIONS): the generated one's handlers, with request parsing that cannot fail,
streams whose client cancellations always reach the replica, and UNAVAILABLE for a lost replica.

Parsing. The proxy parses each request with the handler's request_deserializer before Serve routes
it. With the generated `GenerateRequest.FromString`, bytes that are not a GenerateRequest (a string
field that is not UTF-8, a corrupt wire format) raise inside grpc, and the client gets UNKNOWN
"Unexpected DecodeError" from the proxy. Here they become a MalformedMessage that travels to the
replica like any request, and GenerationService refuses it with INVALID_ARGUMENT naming the message.

Cancellation. When a streaming client cancels (or its deadline passes), grpc cancels the task that
drives the proxy's response generator. Serve's proxy (Ray 2.60, `gRPCProxy.send_request_to_replica`)
cancels the replica's request only if that CancelledError lands while it awaits the replica's next
message. If it lands while grpc is sending a message to the client, the proxy's generator is left
suspended at its `yield`; it is closed later with GeneratorExit, which the proxy catches as a plain
error ("Request failed due to unexpected error ... GeneratorExit") without cancelling anything, and
the replica generates the whole request for nobody. Which of the two happens is a race: seen in 1 of
10 cancels after a deadline, and in 2 of 3 runs of the suite's cancellation test.
`_cancel_propagating` closes the race: the proxy's generator runs in a task of its own that is only
ever suspended awaiting the replica, and a client that goes away cancels that task.

Health while no replica runs. Serve only sends a request to a replica that has finished starting
(loaded, compiled, warmed up), and until one has, the proxy holds every request, health checks
included: a stock client saw DEADLINE_EXCEEDED for the 4 minutes a replica took to start. Health is
answered here instead while the application has no running replica: NOT_SERVING at once, read from
Serve's status (`serve.status()`, at most once a second). Once a replica runs, it answers itself
(NOT_SERVING while it rebuilds after a failure).

Traces. Where the proxy's environment asks for traces (the OTEL_* variables: the proxy reads no serve
option), each Generation call gets a span here, "warpspec.v1.Generation/<Method>", a child of the
client's traceparent; the replica sees this span's traceparent in the call's metadata instead of the
client's, so its spans (warpspec/tracing.py) hang under the proxy's in the same trace.

A replica that dies mid-request (its node or process gone). The proxy reports Ray's ActorDiedError /
ActorUnavailableError as INTERNAL ("The actor ... is unavailable"), though the request did nothing
wrong and another replica can serve it: `_lost_replica_is_unavailable` makes that UNAVAILABLE, the
status clients retry on, as a live replica that cannot serve already answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import re
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.tracing import TRACER_NAME, configure_tracing, parent_context, set_span_in_context

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]


@dataclass(frozen=True)
class MalformedMessage:
    type_name: str  # the message the bytes should have been, e.g. "GenerateRequest"
    error: str  # protobuf's reason
    request_id: str = ""  # handlers that echo a request's id read it from any request

    def describe(self) -> str:
        return f"the {self.type_name} message does not parse: {self.error}"


def _tolerant_parser(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedMessage(message_type.DESCRIPTOR.name, str(e).split(": ")[-1][:200])
    return parse


LOST_REPLICA = re.compile(r"\bactor\b.*\b(unavailable|died|dead)\b", re.IGNORECASE | re.DOTALL)


def _lost_replica_is_unavailable(context) -> None:
    """INTERNAL set by the proxy for a replica actor that died or became unreachable -> UNAVAILABLE."""
    if context.code() == grpc.StatusCode.INTERNAL and LOST_REPLICA.search(context.details() or ""):
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(f"the replica serving this request is gone (retry): {context.details()}")


def _unary_reporting_lost_replicas(unary_handler):
    async def handler(request, context):
        try:
            return await unary_handler(request, context)
        finally:
            _lost_replica_is_unavailable(context)
    return handler


@dataclass(frozen=True)
class _StreamEnd:
    error: BaseException | None = None  # None: the stream finished


def _cancel_propagating(stream_handler):
    """A server-streaming handler that runs stream_handler's async generator in a task of its own
    and writes its messages with `context.write`. The task awaits nothing but the generator, so a
    cancel always lands inside the proxy's wait for the replica's next message, where Serve turns
    it into a cancel of the replica's request.

    This handler is a coroutine, not an async generator, so that grpc's cancel (client cancel or
    deadline) always lands in it, even mid-send, and it finishes the task before returning: the
    proxy's generator still touches the call at its end (context.peer() for the access log), and
    grpc frees the call once the handler returns (doing so later crashed the proxy with SIGSEGV)."""
    async def handler(request, context) -> None:
        messages: asyncio.Queue = asyncio.Queue()  # unbounded: the pump never waits on the client

        async def pump() -> None:
            try:
                async for message in stream_handler(request, context):
                    messages.put_nowait(message)
            except BaseException as e:  # noqa: BLE001 - handed to the handler, which raises it
                messages.put_nowait(_StreamEnd(e))
                raise
            messages.put_nowait(_StreamEnd())

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while True:
                item = await messages.get()
                if isinstance(item, _StreamEnd):
                    if item.error is not None:
                        raise item.error
                    return
                await context.write(item)
        finally:
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):  # its error, if any, was raised above
                await task
            _lost_replica_is_unavailable(context)
    return handler


@functools.cache
def _proxy_tracer():
    """This proxy's tracer, or None where its environment asks for no traces (read once)."""
    provider = configure_tracing(service_name="warpspec-proxy")
    return None if provider is None else provider.get_tracer(TRACER_NAME)


class _ContextWithMetadata:
    """The call's context as Serve's proxy reads it, with other invocation metadata."""

    def __init__(self, context, metadata: tuple[tuple[str, str], ...]):
        self._context, self._metadata = context, metadata

    def invocation_metadata(self):
        return self._metadata

    def __getattr__(self, name):
        return getattr(self._context, name)


def _traced(handler, method: str):
    """handler (request, context) in a server span of the proxy's, whose traceparent replaces the
    client's in what the replica receives; handler itself where tracing is off."""
    tracer = _proxy_tracer()
    if tracer is None:
        return handler

    async def traced(request, context):
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        metadata = tuple(context.invocation_metadata() or ())
        span = tracer.start_span(method, context=parent_context(dict(metadata)), kind=SpanKind.SERVER,
                                 attributes={"rpc.system": "grpc", "rpc.service": SERVICE.full_name,
                                             "rpc.method": method.rsplit("/", 1)[-1]})
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
        ours = tuple((k, v) for k, v in metadata if k.lower() not in ("traceparent", "tracestate"))
        try:
            return await handler(request, _ContextWithMetadata(context, ours + tuple(carrier.items())))
        finally:
            code = context.code()
            if code not in (None, grpc.StatusCode.OK):
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {(context.details() or '')[:160]}"))
            span.end()
    return traced


class GenerationHandlers(grpc.ServiceRpcHandler):
    """The service's method handlers. Serve's gRPC proxy replaces `_method_handlers` with its own
    routing handlers after registration (grpc_util.gRPCGenericServer.add_generic_rpc_handlers), so
    streaming handlers are wrapped when a call looks them up, whatever they are by then."""

    def __init__(self, method_handlers: dict[str, grpc.RpcMethodHandler]):
        self._method_handlers = {f"/{SERVICE.full_name}/{name}": h for name, h in method_handlers.items()}

    def service_name(self) -> str:
        return SERVICE.full_name

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._method_handlers.get(handler_call_details.method)
        method = handler_call_details.method.lstrip("/")
        if handler is not None and inspect.isasyncgenfunction(handler.unary_stream):
            handler = handler._replace(unary_stream=_traced(_cancel_propagating(handler.unary_stream), method))
        elif handler is not None and inspect.iscoroutinefunction(handler.unary_unary):
            handler = handler._replace(unary_unary=_traced(_unary_reporting_lost_replicas(handler.unary_unary),
                                                           method))
        return handler


def add_GenerationServicer_to_server(servicer, server) -> None:  # noqa: N802 - the name grpc's codegen uses
    handlers = {}
    for method in SERVICE.methods:
        request_type, response_type = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=_tolerant_parser(request_type),
                                     response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((GenerationHandlers(handlers),))


HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]
STATUS_TTL_S = 1.0  # how long the proxy trusts one read of Serve's status
_status: tuple[float, object] | None = None  # (when read, serve.status())


async def _serve_status():
    """serve.status(), read in a thread (it blocks) and kept for STATUS_TTL_S; None if unreadable."""
    global _status
    if _status is None or time.monotonic() - _status[0] > STATUS_TTL_S:
        from ray import serve

        try:
            _status = (time.monotonic(), await asyncio.to_thread(serve.status))
        except Exception:  # noqa: BLE001 - no status: Serve routes the check as it would
            return None
    return _status[1]


async def _no_replica_runs(context) -> bool:
    """Whether the application the call names (gRPC metadata `application`, else the only one) is
    known to Serve and has no running replica yet."""
    status = await _serve_status()
    if status is None:
        return False
    named = dict(context.invocation_metadata() or ()).get("application")
    apps = status.applications
    app = apps.get(named) if named else next(iter(apps.values())) if len(apps) == 1 else None
    if app is None:
        return False
    return not any(d.replica_states.get("RUNNING", 0) for d in app.deployments.values())


def _not_serving_until_a_replica_runs(check_handler):
    async def handler(request, context):
        if await _no_replica_runs(context):
            # Serve's routing handlers send back the replica's bytes: so does this one.
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING).SerializeToString()
        return await check_handler(request, context)
    return handler


class HealthHandlers(grpc.ServiceRpcHandler):
    """grpc.health.v1.Health through Serve's proxy, with Check answered NOT_SERVING while the
    application has no running replica (the module docstring). Wrapped at lookup, as
    GenerationHandlers are."""

    def __init__(self, method_handlers: dict[str, grpc.RpcMethodHandler]):
        self._method_handlers = {f"/{HEALTH_SERVICE.full_name}/{name}": h for name, h in method_handlers.items()}

    def service_name(self) -> str:
        return HEALTH_SERVICE.full_name

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._method_handlers.get(handler_call_details.method)
        if handler is not None and handler_call_details.method.endswith("/Check") \
                and inspect.iscoroutinefunction(handler.unary_unary):
            handler = handler._replace(unary_unary=_not_serving_until_a_replica_runs(handler.unary_unary))
        return handler


def add_HealthServicer_to_server(servicer, server) -> None:  # noqa: N802 - the name grpc's codegen uses
    make = {False: grpc.unary_unary_rpc_method_handler, True: grpc.unary_stream_rpc_method_handler}
    handlers = {method.name: make[method.server_streaming](
                    getattr(servicer, method.name), request_deserializer=health_pb2.HealthCheckRequest.FromString,
                    response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
                for method in HEALTH_SERVICE.methods}
    server.add_generic_rpc_handlers((HealthHandlers(handlers),))
