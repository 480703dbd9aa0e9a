"""The warpspec.v1.Generation RPCs and the grpc.health.v1 Check, over a ReplicaFrontend.

Transport-neutral: each method takes the request message and returns (or yields) the response;
errors propagate as exceptions. The Serve deployment (deployment.py) calls these from methods named
like the RPCs, which is how Serve's gRPC proxy routes (`/warpspec.v1.Generation/Generate` -> the
deployment's `Generate` method), and its grpc_method decorator sets each error as the call's gRPC
status (wire_errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from grpc_health.v1 import health_pb2

from warpspec.errors import EngineError, NotFoundError
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.serving.auth import ApiKeyAuth
from warpspec.serving.limits import RequestLimits
from warpspec.serving.replica_frontend import ReplicaFrontend
from warpspec.serving.request_mapping import reject_unknown_fields, request_from_proto, response_from_output

# The names a health client may ask about: "" (the whole server) and the generation service answer
# readiness; "liveness" answers whether the replica is alive (Kubernetes' livenessProbe names it).
READINESS_SERVICE_NAMES = ("", pb.DESCRIPTOR.services_by_name["Generation"].full_name)
LIVENESS_SERVICE_NAME = "liveness"
HEALTH_SERVICE_NAMES = (*READINESS_SERVICE_NAMES, LIVENESS_SERVICE_NAME)


class GenerationService:
    def __init__(self, frontend: ReplicaFrontend, limits: RequestLimits | None = None, auth: ApiKeyAuth | None = None):
        self.frontend = frontend
        self.limits = limits or RequestLimits()
        self.auth = auth

    def authorize(self, grpc_context) -> None:
        """Every RPC but the health check calls this first: a wrong or missing key is UNAUTHENTICATED
        before the request is even parsed."""
        if self.auth is not None:
            self.auth.check_grpc(grpc_context)

    async def generate(self, request: pb.GenerateRequest, metadata=()) -> pb.GenerateResponse:
        """metadata: the call's (key, value) pairs, where a W3C traceparent may come."""
        prompt, params = request_from_proto(request, self.frontend.description.max_model_len, self.limits)
        final = None
        async for out in self.frontend.stream(prompt, params, request.request_id or None, dict(metadata or ())):
            final = out
        return response_from_output(final, streaming=False)

    async def generate_stream(self, request: pb.GenerateRequest, metadata=()) -> AsyncIterator[pb.GenerateResponse]:
        """One message per engine step that added text or tokens, the final one with usage. A client
        that cancels closes this generator, which aborts the request (AsyncLLM frees its KV)."""
        prompt, params = request_from_proto(request, self.frontend.description.max_model_len, self.limits)
        async for out in self.frontend.stream(prompt, params, request.request_id or None, dict(metadata or ())):
            if out.new_token_ids or out.new_text or out.finished:
                yield response_from_output(out, streaming=True)

    def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        reject_unknown_fields(request, "TokenizeRequest")
        self.limits.check_request_bytes(request.ByteSize(), "TokenizeRequest")
        self.limits.check_prompt_text(request.text, "text")
        ids, tokens = self.frontend.tokenize(request.text)
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    def model_info(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:
        reject_unknown_fields(request, "GetModelInfoRequest")
        d = self.frontend.description
        return pb.ModelInfo(model=d.name, model_path=d.path, max_model_len=d.max_model_len,
                            num_workers=d.num_workers, draft=d.drafter or "",
                            speculative_method=d.speculative_method or "",
                            num_speculative_tokens=d.num_speculative_tokens if d.drafter else 0,
                            vocab_size=d.vocab_size, dtype=d.dtype)

    def health_check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        """Readiness for "" and the generation service: SERVING once the model is loaded and warmed up
        (a replica only takes traffic after its constructor, which does both), NOT_SERVING while its
        engine is failed, stuck or rebuilding, or the replica drains. Liveness for "liveness":
        NOT_SERVING only when the replica cannot recover by itself (ReplicaFrontend.check_alive).
        NOT_FOUND for a service name not served here, as the standard servicer answers."""
        if request.service not in HEALTH_SERVICE_NAMES:
            raise NotFoundError(f"service {request.service!r} is not served here; "
                                      f"known: {', '.join(repr(n) for n in HEALTH_SERVICE_NAMES)}")
        check = self.frontend.check_alive if request.service == LIVENESS_SERVICE_NAME else self.frontend.check_health
        try:
            check()
        except EngineError:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
