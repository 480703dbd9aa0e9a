"""Every error warpspec raises to its users, in one place:
- requests refused at the boundary, before anything is queued (InvalidRequestError and its kinds);
- the engine unable to do the work (EngineError: dead workers, no placement, a full queue, a
  draining replica), and a step that failed for its own requests only (StepFailedError).
A checkpoint that cannot be loaded raises workers.errors.CheckpointError (the workers import nothing
of this package); it is re-exported here. The serving layer maps each to a gRPC status and an HTTP
code (serving/wire_errors.py)."""

from __future__ import annotations

from warpspec.workers.errors import CheckpointError

__all__ = ["CheckpointError", "EngineError", "EngineOverloadedError", "InvalidRequestError", "NotFoundError",
           "PlacementError", "ReplicaDrainingError", "RequestTooLargeError", "StepFailedError",
           "UnauthenticatedError", "WorkerDiedError"]


# ---- the engine cannot do the work -------------------------------------------------------------

class EngineError(RuntimeError):
    """The replica could not run a step; in-flight requests fail with this."""


class WorkerDiedError(EngineError):
    """A worker or the coordinator of the replica died: the replica must be rebuilt."""


class PlacementError(EngineError):
    """The Ray cluster cannot host the requested workers (now, or within the placement timeout)."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the request was not accepted."""


class ReplicaDrainingError(EngineError):
    """The replica is shutting down (scale-down, redeploy): the request belongs on another replica."""


class StepFailedError(RuntimeError):
    """A step failed for a reason other than the replica's workers (a bug, a bad tensor): the requests
    it ran are aborted with this error and the engine goes on serving the others. Not an EngineError,
    because nothing needs rebuilding."""

    def __init__(self, request_ids: list[str], message: str):
        super().__init__(message)
        self.request_ids = request_ids

    @classmethod
    def caused_by(cls, request_ids: list[str], cause: BaseException) -> StepFailedError:
        first_line = (str(cause).splitlines() or [""])[0][:200]
        return cls(request_ids, f"the engine step running this request failed ({type(cause).__name__}: {first_line})")

    def __reduce__(self):  # crosses from the coordinator to the replica intact
        return type(self), (self.request_ids, str(self))


# ---- requests refused at the boundary -----------------------------------------------------------

class InvalidRequestError(ValueError):
    """A request the engine refuses before it touches the batch; the message names the field."""


class RequestTooLargeError(InvalidRequestError):
    """A request body or message over max_request_bytes (HTTP 413; gRPC INVALID_ARGUMENT, not retryable)."""


class UnauthenticatedError(PermissionError):
    """The request carried no API key, or a wrong one."""


class NotFoundError(LookupError):
    """A request named a model (OpenAI API) or a service (gRPC health) this deployment does not serve."""
