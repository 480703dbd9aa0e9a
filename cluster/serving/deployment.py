"""The Ray Serve deployment: one replica = one AsyncLLM behind a ReplicaFrontend (and, with
num_workers > 1 or executor="ray", its coordinator actor, which holds rank 0, and the worker actors of
ranks 1..N-1, all in the replica's own gang: executor/placement.py's serving_bundles).

Two ingresses reach it:
- gRPC, through Serve's gRPC proxy: the proxy registers the servicers named in
  serve_config.GRPC_SERVICER_FUNCTIONS and routes `/<package.Service>/<Method>` to the replica method
  of the same name (Generate, GenerateStream, Tokenize, GetModelInfo, and Check for grpc.health.v1).
  A method sets its status on Serve's `grpc_context`; a unary one then returns an empty message, a
  streaming one raises (Serve keeps a user-set code and details; the proxy logs the exception).
- HTTP: the OpenAI app of openai_api.py, built per replica by `__serve_build_asgi_app__` (so its
  routes close over this replica's engine rather than a pickled copy).

Faults and shutdown:
- a step that fails fatally (a worker or the coordinator died) fails the requests in flight with
  UNAVAILABLE / 503 and starts rebuilding the engine in place (ReplicaFrontend); `check_health` fails
  until it is back. If rebuilding fails, or outlasts Serve's patience (3 failed checks in a row, one
  every health_check_period_s; only a passing check resets the count, so the failed checks of a
  rebuild still count towards a second fault that comes before Serve's next check), Serve replaces the
  whole replica instead.
- scale-down and redeploys: Serve stops routing to the replica and waits up to
  graceful_shutdown_timeout_s for its requests; `__del__` then ends any stragglers (UNAVAILABLE) after
  drain_timeout_s and releases the coordinator, workers and placement group. A replica killed outright
  releases them too: its coordinator is fate-shared with it, and the placement group with the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from grpc_health.v1 import health_pb2
from ray import serve

from warpspec.core.startup import show_startup_log
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.serving.grpc_service import GenerationService
from warpspec.serving.logs import configure_logging
from warpspec.serving.metrics import ReplicaStats, ServingMetrics
from warpspec.serving.openai_api import build_openai_app
from warpspec.serving.replica_frontend import ReplicaFrontend, ReplicaProcesses
from warpspec.serving.serve_config import ReplicaSettings
from warpspec.serving.wire_errors import wire_error
from warpspec.tracing import TRACER_NAME, configure_tracing

logger = logging.getLogger("warpspec.serving")

STATS_PERIOD_S = 1.0  # how often the replica's gauges (queue, running, KV usage) are sampled
REPLICA_METADATA_KEY = "warpspec-replica"  # trailing metadata of Generate: the serving replica's id


class GrpcStatusError(Exception):
    """Raised after the status is set on grpc_context; only its message reaches the client."""


def _set_status(grpc_context, error: BaseException) -> str:
    wire = wire_error(error)
    if grpc_context is not None:
        grpc_context.set_code(wire.grpc_code)
        grpc_context.set_details(wire.message)
    return wire.message


def grpc_method(empty_reply, authorized: bool = True):
    """A unary gRPC method of the replica: the caller's API key checked first (unless not authorized:
    health), and any failure set as the call's status (wire_errors.py) and answered with
    empty_reply(request)."""
    def wrap(method):
        @functools.wraps(method)  # Serve reads the method's own parameters (grpc_context) through it
        async def call(self, request, grpc_context=None):
            try:
                if authorized:
                    self.service.authorize(grpc_context)
                return await method(self, request, grpc_context)
            except Exception as e:  # noqa: BLE001 - mapped to a status; CancelledError passes through
                _set_status(grpc_context, e)
                return empty_reply(request)
        return call
    return wrap


def grpc_stream_method(method):
    """grpc_method for a server-streaming method: a failure sets the status and ends the stream."""
    @functools.wraps(method)
    async def call(self, request, grpc_context=None):
        try:
            self.service.authorize(grpc_context)
            async for response in method(self, request, grpc_context):
                yield response
        except Exception as e:  # noqa: BLE001
            raise GrpcStatusError(_set_status(grpc_context, e)) from None
    return call


def _metadata(grpc_context) -> tuple:
    return tuple(grpc_context.invocation_metadata() or ()) if grpc_context is not None else ()


def _match_threads_to_reserved_cpus() -> None:
    """Compute with as many torch threads as CPUs the replica reserved (num_cpus). Ray only sets
    OMP_NUM_THREADS when the driver had none, and a replica inheriting more threads than it reserved
    spin-waits on a busy machine: measured 30x slower steps (2 threads, 1 CPU, another job running)."""
    import ray
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    torch.set_num_threads(max(1, int(cpus)))


@serve.deployment(name="WarpspecServer")
@serve.ingress()
class WarpspecServer:
    async def __init__(self, settings: ReplicaSettings):
        """settings: ServeConfig.replica_settings (app.build_app)."""
        _match_threads_to_reserved_cpus()
        configure_logging(settings.log_format)
        show_startup_log()
        llm = await AsyncLLM.create(settings.model, **settings.engine)
        metrics = ServingMetrics(settings.model_name or llm.config.model.rstrip("/").split("/")[-1],
                                 llm.config.speculative.describe(), settings.min_acceptance_length)
        self.tracing = configure_tracing(settings.otlp_traces_endpoint)
        self.frontend = ReplicaFrontend(llm, settings.model_name, metrics, settings.stream_interval,
                                      stream_gap_s=settings.stream_gap_ms / 1000,
                                      stall_timeout_s=settings.stall_timeout_s,
                                      tracer=None if self.tracing is None else self.tracing.get_tracer(TRACER_NAME))
        self.drain_timeout_s = settings.drain_timeout_s
        self.limits, self.auth = settings.limits, settings.auth  # auth None: no API key required
        self.service = GenerationService(self.frontend, self.limits, self.auth)
        # Sent back with every unary reply, so a client (and the autoscaling check) sees which replica served it.
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        if settings.warmup:  # the replica counts as started (and gets traffic) only after this
            await self.frontend.warm_up()
        self.stats_task = asyncio.get_running_loop().create_task(self._every_period(metrics))

    async def _every_period(self, metrics: ServingMetrics) -> None:
        """Each STATS_PERIOD_S: the gauges, and the stall watchdog (ReplicaFrontend.check_progress)."""
        while True:
            with contextlib.suppress(Exception):  # a gauge failing to export must not stop serving
                metrics.record_stats(self.frontend.stats())
            self.frontend.check_progress()
            await asyncio.sleep(STATS_PERIOD_S)

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.frontend, replica_id=self.replica_id, limits=self.limits, auth=self.auth)

    # ---- gRPC: warpspec.v1.Generation ----------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:  # noqa: N802
        if grpc_context is not None:
            grpc_context.set_trailing_metadata([(REPLICA_METADATA_KEY, self.replica_id)])
        return await self._generate(request, grpc_context)

    @grpc_method(lambda request: pb.GenerateResponse(request_id=request.request_id))
    async def _generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        return await self.service.generate(request, _metadata(grpc_context))

    @grpc_stream_method
    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):  # noqa: N802
        async for response in self.service.generate_stream(request, _metadata(grpc_context)):
            yield response

    @grpc_method(lambda _: pb.TokenizeResponse())
    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context=None) -> pb.TokenizeResponse:  # noqa: N802
        return self.service.tokenize(request)

    @grpc_method(lambda _: pb.ModelInfo())
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context=None) -> pb.ModelInfo:  # noqa: N802
        return self.service.model_info(request)

    # ---- gRPC: grpc.health.v1.Health -------------------------------------------------------------

    @grpc_method(lambda _: health_pb2.HealthCheckResponse(), authorized=False)
    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    grpc_context=None) -> health_pb2.HealthCheckResponse:
        return self.service.health_check(request)

    # ---- Serve hooks and admin -------------------------------------------------------------------

    async def check_health(self) -> None:
        self.frontend.check_health()

    async def stats(self) -> ReplicaStats:
        return self.frontend.stats()

    async def processes(self) -> ReplicaProcesses:
        return await self.frontend.processes()

    async def __del__(self):
        # A constructor that failed (a bad checkpoint) leaves some of these unset.
        if getattr(self, "stats_task", None) is not None:
            self.stats_task.cancel()
        if getattr(self, "frontend", None) is not None:
            await self.frontend.shutdown(self.drain_timeout_s)
        if getattr(self, "tracing", None) is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the spans still in the batch go out
