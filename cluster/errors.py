"""Errors the engine raises when its workers cannot do the work (as opposed to bad requests)."""


class EngineError(RuntimeError):
    """The replica could not run a step; in-flight requests fail with this."""


class WorkerDiedError(EngineError):
    pass


class PlacementError(EngineError):
    """The Ray cluster cannot host the requested workers (now, or within the placement timeout)."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the request was not accepted."""
