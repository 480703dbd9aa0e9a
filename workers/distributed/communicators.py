"""A rank's communicator for its collective backend (CommInit.backend): the local no-op for one rank,
gloo's TCP (comm.py), shared memory between ranks of one host (shm_comm.py), or NCCL (comm.py)."""

from __future__ import annotations

from warpspec.workers.distributed.comm import CommInit, Communicator, GlooCommunicator, NcclCommunicator
from warpspec.workers.distributed.shm_comm import SharedMemoryCommunicator

BACKENDS = ("local", "gloo", "shm", "nccl")


def make_communicator(init: CommInit) -> Communicator:
    if init.backend not in BACKENDS:
        raise ValueError(f"unknown collective backend {init.backend!r}; use one of {', '.join(BACKENDS)}")
    if init.world_size == 1 or init.backend == "local":
        if init.world_size != 1:
            raise ValueError(f"the local backend serves one rank, not {init.world_size}")
        return Communicator()
    if init.backend == "gloo":
        return GlooCommunicator(init)
    if init.backend == "shm":
        return SharedMemoryCommunicator(init)
    return NcclCommunicator(init)
