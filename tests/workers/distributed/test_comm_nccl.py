"""The NCCL backend needs GPUs and the NCCL library: this runs where two GPUs exist and is skipped
elsewhere (a machine without a GPU can import cupy but not allocate with it)."""

from __future__ import annotations

import pytest
import torch

from warpspec.kernels import add_rms_norm
from warpspec.workers.distributed.comm import CommInit
from warpspec.workers.distributed.communicators import make_communicator

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA GPUs")


def _rank_main(rank: int, unique_id: bytes, results) -> None:
    torch.cuda.set_device(rank)
    comm = make_communicator(CommInit("nccl", rank, 2, nccl_unique_id=unique_id))
    gen = torch.Generator().manual_seed(rank)
    partial = torch.randn(5, 64, generator=gen).cuda()
    residual = torch.ones(5, 64).cuda()
    weight = torch.full((64,), 0.5).cuda()
    normed, new_residual = comm.allreduce_residual_rmsnorm(partial.clone(), residual, weight, 1e-5)
    gathered = comm.gather(torch.full((2, 3), float(rank)).cuda())
    torch.cuda.synchronize()
    results[rank] = (normed.cpu(), new_residual.cpu(), None if gathered is None else gathered.cpu())
    comm.close()


@needs_two_gpus
def test_nccl_fused_allreduce_matches_the_reference():
    import torch.multiprocessing as mp

    from warpspec.workers.distributed.comm import make_nccl_unique_id

    unique_id = make_nccl_unique_id()
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(unique_id, results), nprocs=2, join=True)
    total = sum(torch.randn(5, 64, generator=torch.Generator().manual_seed(r)) for r in range(2))
    expected_normed, expected_residual = add_rms_norm(total, torch.ones(5, 64), torch.full((64,), 0.5), 1e-5)
    for rank in range(2):
        torch.testing.assert_close(results[rank][0], expected_normed, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[rank][1], expected_residual, atol=1e-5, rtol=1e-5)
    assert torch.equal(results[0][2], torch.tensor([[0.0] * 3 + [1.0] * 3] * 2))
    assert results[1][2] is None
