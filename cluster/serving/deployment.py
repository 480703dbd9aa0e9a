"""The Ray Serve deployment: one replica = one AsyncLLM (and, with num_workers > 1 or executor="ray",
its coordinator actor and N worker actors in the replica's own placement group).

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
  until it is back. If rebuilding fails, or outlasts Serve's patience (3 failed checks, one every
  health_check_period_s), Serve replaces the whole replica instead.
- scale-down and redeploys: Serve stops routing to the replica and waits up to
  graceful_shutdown_timeout_s for its requests; `__del__` then ends any stragglers (UNAVAILABLE) after
  drain_timeout_s and releases the coordinator, workers and placement group. A replica killed outright
  releases them too: its coordinator is fate-shared with it, and the placement group with the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from grpc_health.v1 import health_pb2
from ray import serve

from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.serving.auth import ApiKeyAuth
from warpspec.serving.grpc_service import GenerationService
from warpspec.serving.limits import RequestLimits
from warpspec.serving.metrics import ReplicaStats, ServingMetrics
from warpspec.serving.openai_api import build_openai_app
from warpspec.serving.replica_frontend import ReplicaFrontend, ReplicaProcesses
from warpspec.serving.wire_errors import wire_error

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
    async def __init__(self, model: str, engine_options: dict, model_name: str | None = None, warmup: bool = True,
                       stream_interval: int = 1, drain_timeout_s: float = 5.0, limits: RequestLimits | None = None,
                       auth: ApiKeyAuth | None = None, stream_gap_ms: float = 0.0):
        _match_threads_to_reserved_cpus()
        llm = await AsyncLLM.create(model, **engine_options)
        metrics = ServingMetrics(model_name or llm.config.model.rstrip("/").split("/")[-1])
        self.engine = ReplicaFrontend(llm, model_name, metrics, stream_interval, stream_gap_s=stream_gap_ms / 1000)
        self.drain_timeout_s = drain_timeout_s
        self.limits, self.auth = limits or RequestLimits(), auth  # auth None: no API key required
        self.service = GenerationService(self.engine, self.limits, auth)
        # Sent back with every unary reply, so a client (and the autoscaling check) sees which replica served it.
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        if warmup:  # the replica counts as started (and gets traffic) only after this
            await self.engine.warm_up()
        self.stats_task = asyncio.get_running_loop().create_task(self._sample_stats(metrics))

    async def _sample_stats(self, metrics: ServingMetrics) -> None:
        while True:
            with contextlib.suppress(Exception):  # a gauge failing to export must not stop serving
                metrics.record_stats(self.engine.stats())
            await asyncio.sleep(STATS_PERIOD_S)

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.engine, replica_id=self.replica_id, limits=self.limits, auth=self.auth)

    # ---- gRPC: warpspec.v1.Generation ----------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:  # noqa: N802
        if grpc_context is not None:
            grpc_context.set_trailing_metadata([(REPLICA_METADATA_KEY, self.replica_id)])
        try:
            self.service.authorize(grpc_context)
            return await self.service.generate(request)
        except Exception as e:  # noqa: BLE001 - mapped to a status; CancelledError passes through
            _set_status(grpc_context, e)
            return pb.GenerateResponse(request_id=request.request_id)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):  # noqa: N802
        try:
            self.service.authorize(grpc_context)
            async for response in self.service.generate_stream(request):
                yield response
        except Exception as e:  # noqa: BLE001
            raise GrpcStatusError(_set_status(grpc_context, e)) from None

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context=None) -> pb.TokenizeResponse:  # noqa: N802
        try:
            self.service.authorize(grpc_context)
            return self.service.tokenize(request)
        except Exception as e:  # noqa: BLE001
            _set_status(grpc_context, e)
            return pb.TokenizeResponse()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context=None) -> pb.ModelInfo:  # noqa: N802
        try:
            self.service.authorize(grpc_context)
            return self.service.model_info(request)
        except Exception as e:  # noqa: BLE001
            _set_status(grpc_context, e)
            return pb.ModelInfo()

    # ---- gRPC: grpc.health.v1.Health -------------------------------------------------------------

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    grpc_context=None) -> health_pb2.HealthCheckResponse:
        try:
            return self.service.health_check(request)
        except Exception as e:  # noqa: BLE001
            _set_status(grpc_context, e)
            return health_pb2.HealthCheckResponse()

    # ---- Serve hooks and admin -------------------------------------------------------------------

    async def check_health(self) -> None:
        self.engine.check_health()

    async def stats(self) -> ReplicaStats:
        return self.engine.stats()

    async def processes(self) -> ReplicaProcesses:
        return await self.engine.processes()

    async def __del__(self):
        # A constructor that failed (a bad checkpoint) leaves some of these unset.
        if getattr(self, "stats_task", None) is not None:
            self.stats_task.cancel()
        if getattr(self, "engine", None) is not None:
            await self.engine.shutdown(self.drain_timeout_s)
