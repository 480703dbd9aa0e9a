"""How a failure looks on the wire: one table from exception to gRPC status, HTTP status and the
OpenAI error `type`, so that both front ends say the same thing. Messages are one readable line;
a traceback never reaches a client (it goes to the replica's log)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from warpspec.errors import (
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    NotFoundError,
    RequestTooLargeError,
    UnauthenticatedError,
)

logger = logging.getLogger("warpspec.serving")


@dataclass(frozen=True)
class WireError:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str  # the `error.type` of an OpenAI error body
    message: str



def wire_error(error: BaseException) -> WireError:
    if isinstance(error, UnauthenticatedError):
        return WireError(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", str(error))
    if isinstance(error, RequestTooLargeError):
        return WireError(grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error", str(error))
    if isinstance(error, InvalidRequestError):
        return WireError(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", str(error))
    if isinstance(error, NotFoundError):
        return WireError(grpc.StatusCode.NOT_FOUND, 404, "not_found_error", str(error))
    if isinstance(error, EngineOverloadedError):
        return WireError(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", str(error))
    if isinstance(error, asyncio.TimeoutError | TimeoutError):
        return WireError(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error",
                         str(error) or "the request ran past its deadline")
    if isinstance(error, asyncio.CancelledError):
        return WireError(grpc.StatusCode.CANCELLED, 499, "cancelled", "the request was cancelled")
    if isinstance(error, EngineError):
        # A dead worker or an impossible placement: this replica cannot serve; another might.
        return WireError(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", str(error).splitlines()[0])
    logger.exception("unexpected error while serving a request", exc_info=error)
    first_line = (str(error).splitlines() or [""])[0][:200]
    return WireError(grpc.StatusCode.INTERNAL, 500, "internal_error",
                     f"internal error ({type(error).__name__}: {first_line}); see the replica's log")
