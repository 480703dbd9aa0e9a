"""Errors a user can cause when pointing warpspec at a checkpoint."""


class CheckpointError(ValueError):
    """A checkpoint folder, config or tensor file that warpspec cannot load; the message names why."""
