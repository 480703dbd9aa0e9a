"""Errors the engine raises when its workers cannot do the work (as opposed to bad requests)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The replica could not run a step; in-flight requests fail with this."""


class WorkerDiedError(EngineError):
    pass


class PlacementError(EngineError):
    """The Ray cluster cannot host the requested workers (now, or within the placement timeout)."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the request was not accepted."""


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
