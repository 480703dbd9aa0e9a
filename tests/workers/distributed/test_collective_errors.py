"""A collective that fails inside the backend (a peer rank died) surfaces as CollectiveError, which
the coordinator turns into WorkerDiedError; the base class's missing-backend error stays itself."""

from __future__ import annotations

import pytest
import torch

from warpspec.workers.distributed.comm import CollectiveError, Communicator


class PeerGone(Communicator):
    def exchange_sum(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43739: Connection reset by peer")


def test_backend_failure_becomes_collective_error():
    comm = PeerGone(rank=0, world_size=2)
    with pytest.raises(CollectiveError, match="PeerGone collective failed: .*Connection reset by peer"):
        comm.all_reduce(torch.ones(2))


def test_missing_backend_is_not_a_collective_failure():
    comm = Communicator(rank=0, world_size=2)
    with pytest.raises(NotImplementedError):
        comm.gather(torch.ones(2))
