"""A compiled step meets its peers inside its graph (workers/distributed/traced_collectives.py), over gloo and
over shared memory alike, built by the compiler and inductor options the engine's compiled steps use
(compiled_step.CountingCompiler: the C++ wrapper included, which could not call torch's functional
collectives on the CPU). A rank's step saved whole is loaded by the next start of that rank."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from helpers.rank_processes import rank_partial, run_two_ranks
from warpspec.workers.compile.compiled_step import CountingCompiler
from warpspec.workers.compile.step_artifacts import StepArtifacts
from warpspec.workers.distributed.comm import CommInit
from warpspec.workers.distributed.communicators import make_communicator
from warpspec.workers.distributed.shm_comm import shared_memory_available
from warpspec.workers.distributed.traced_collectives import register, unregister

BACKENDS = ["gloo", pytest.param("shm", marks=pytest.mark.skipif(not shared_memory_available(),
                                                                  reason="needs an x86-64 host with /dev/shm"))]


def _compiled_step(rank: int, port: int, results, backend: str, cache_dir: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # graphs built here, not a cache's
    torch.set_num_threads(1)
    comm = make_communicator(CommInit(backend, rank, 2, "127.0.0.1", port))

    def step(x: torch.Tensor):
        reduced = comm.all_reduce(x * 2)
        return reduced + 1, comm.gather(reduced[:, :2], dim=-1)

    compiled = CountingCompiler(step)
    outputs = [compiled(rank_partial(rank, (3, 4)) + i) for i in range(3)]
    results[rank] = (outputs, comm.num_collectives, compiled.num_compiles)
    comm.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_step_calls_the_exchange_inside_one_graph(backend, tmp_path):
    """Every rank sums, rank 0 gathers, both in one graph: one compile serves three calls. Rank 1
    drops its gather's result; the exchange must stay in its graph all the same, or rank 0 would wait
    for it forever."""
    results = run_two_ranks(functools.partial(_compiled_step, backend=backend, cache_dir=str(tmp_path)))
    for i in range(3):
        # 2 * (a + i) + 2 * (b + i), then + 1
        reduced = 2 * (rank_partial(0, (3, 4)) + i) + 2 * (rank_partial(1, (3, 4)) + i)
        for rank in (0, 1):
            assert torch.allclose(results[rank][0][i][0], reduced + 1)
        assert torch.allclose(results[0][0][i][1], torch.cat([reduced[:, :2]] * 2, dim=-1))
        assert results[1][0][i][1] is None
    for rank in (0, 1):
        assert results[rank][1] == 0  # traced collectives are not counted
        assert results[rank][2] == 1  # one graph, no break at a collective, no recompile


class ShardedLinear(torch.nn.Module):
    """A row-parallel layer: the model holds its communicator, as the engine's models do."""

    def __init__(self, comm, rank: int):
        super().__init__()
        self.comm = comm
        self.weight = torch.nn.Parameter(rank_partial(rank, (4, 4)), requires_grad=False)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x @ self.weight) + 1


def _saved_step(rank: int, port: int, results, backend: str, cache_dir: str, shifted_rank: int | None) -> None:
    torch.set_num_threads(1)
    if rank == shifted_rank:  # another communicator of this process holds the first group id
        register(None)
    comm = make_communicator(CommInit(backend, rank, 2, "127.0.0.1", port))
    model = ShardedLinear(comm, rank)
    compiled = CountingCompiler(model.step, StepArtifacts(f"rank {rank}", cache_dir),
                                mark_dynamic=lambda args: torch._dynamo.mark_dynamic(args[0], 0))
    with torch.inference_mode():
        outputs = [compiled(torch.full((rows, 4), float(rows)), graph="step") for rows in (2, 5)]
    results[rank] = (outputs, compiled.num_compiles, compiled.num_loaded, comm.group_id)
    comm.close()
    if rank == shifted_rank:
        unregister(0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_ranks_step_saved_whole_is_loaded_by_its_next_start(backend, tmp_path):
    """Saving a step whole pickles what it reaches, the model's communicator included (a process
    group, shared memory): each rank saves its own, and the next start loads it, compiling nothing,
    with the same sums. A rank whose communicator got another group id compiles again (the id is a
    constant of the graph, which its guards check) and still meets its peer's loaded step."""
    first, second = (run_two_ranks(functools.partial(_saved_step, backend=backend, cache_dir=str(tmp_path),
                                                     shifted_rank=shifted))
                     for shifted in (None, 1))
    expected = [torch.full((rows, 4), float(rows)) @ (rank_partial(0, (4, 4)) + rank_partial(1, (4, 4))) + 1
                for rows in (2, 5)]
    assert [first[rank][1:] for rank in (0, 1)] == [(1, 0, 0), (1, 0, 0)]
    assert [second[rank][1:] for rank in (0, 1)] == [(0, 1, 0), (1, 0, 1)]
    for run in (first, second):
        for rank in (0, 1):
            for got, want in zip(run[rank][0], expected, strict=True):
                torch.testing.assert_close(got, want)
