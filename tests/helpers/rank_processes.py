"""Run a function as two real rank processes (spawned, as Ray's workers are separate processes)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from warpspec.workers.worker import address_and_free_port


def run_two_ranks(target, a_rank_exits: bool = False) -> dict:
    """target(rank, port, results) in two processes; returns each rank's results. A rank that raises
    fails the test with its traceback; when a rank is meant to exit, the others are waited for one by
    one (the context would kill them at its exit)."""
    results = mp.Manager().dict()
    _, port = address_and_free_port()
    context = mp.start_processes(target, args=(port, results), nprocs=2, join=False, start_method="spawn")
    if a_rank_exits:
        for process in context.processes:
            process.join(timeout=120)
    else:
        while not context.join(timeout=120):
            pass
    return dict(results)


def rank_partial(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A rank's own random tensor, the same on every call with these arguments."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(dtype)
