"""Same-host CPU ranks meet in shared memory (workers/distributed/shm_comm.py): sums that agree bit for bit on
every rank, in chunks when a tensor outgrows a slot; gathers; a dead peer,
or one that fails its part of a step, ends the wait with CollectiveError; the segment's name is gone
once every rank has mapped it."""

from __future__ import annotations

import contextlib
import glob
import os
import time

import pytest
import torch

from helpers.rank_processes import rank_partial, run_two_ranks
from warpspec.workers.distributed.comm import CollectiveError, CommInit
from warpspec.workers.distributed.communicators import make_communicator
from warpspec.workers.distributed.shm_comm import shared_memory_available

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs an x86-64 host with /dev/shm")

SLOT_BYTES = 4096  # small, so that a [300, 7] float32 tensor (8,400 B) goes through in 3 chunks


def _join(port: int, rank: int):
    from warpspec.workers.distributed.shm_comm import SharedMemoryCommunicator

    return SharedMemoryCommunicator(CommInit("shm", rank, 2, "127.0.0.1", port), slot_bytes=SLOT_BYTES)


def _sum_and_gather(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    comm = _join(port, rank)
    segment_names = glob.glob(f"/dev/shm/warpspec-comm-{os.getpid()}-*")
    sums = {str(dtype): comm.all_reduce(rank_partial(rank, (300, 7), dtype))
            for dtype in (torch.float32, torch.bfloat16)}
    small = comm.all_reduce(rank_partial(rank, (1, 5), torch.float32))
    gathered = comm.gather(torch.full((2, 3), float(rank)), dim=-1)
    results[rank] = (sums, small, gathered, segment_names, comm.num_collectives)
    comm.close()


def _peer_dies(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    comm = _join(port, rank)
    comm.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(1)  # as SIGKILL would: no close, no goodbye
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
        results[rank] = ("returned", time.monotonic() - start)
    except CollectiveError as e:
        results[rank] = (str(e), time.monotonic() - start)


def _peer_fails(rank: int, port: int, results) -> None:
    """Rank 1's part of a step raises before its collective; rank 0 waits for it in one."""
    torch.set_num_threads(1)
    comm = _join(port, rank)
    comm.all_reduce(torch.ones(4))
    start = time.monotonic()
    outcomes = []
    for _ in range(2):  # the step that fails, then one after it
        try:
            with comm.failing_together():
                if rank == 1:
                    raise ValueError("a bad step delta")
                comm.all_reduce(torch.ones(4))
            outcomes.append("returned")
        except (CollectiveError, ValueError) as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    results[rank] = (outcomes, time.monotonic() - start, comm.abandoned)
    comm.close()


def _peer_abandons_right_after_publishing(rank: int, port: int, results) -> None:
    """Rank 1 publishes collective 1, then abandons before rank 0 has looked at its flag (rank 0
    waits 0.5 s before looking): collective 1 must still succeed on rank 0, and collective 2 fail."""
    from warpspec.workers.distributed.shm_comm import SharedMemoryCommunicator

    class SlowToLook(SharedMemoryCommunicator):
        def _wait_for_peers(self) -> None:
            time.sleep(0.5)
            super()._wait_for_peers()

    torch.set_num_threads(1)
    comm = (SlowToLook if rank == 0 else SharedMemoryCommunicator)(CommInit("shm", rank, 2, "127.0.0.1", port),
                                                                   slot_bytes=SLOT_BYTES)
    first = comm.all_reduce(torch.full((4,), rank + 1.0))
    if rank == 1:
        with contextlib.suppress(ValueError), comm.failing_together():
            raise ValueError("a bad step delta")
        time.sleep(2.0)  # keep the segment's peer alive while rank 0 reads collective 1
        results[rank] = (first, None)
        return
    try:
        comm.all_reduce(torch.ones(4))
        second = "returned"
    except CollectiveError as e:
        second = str(e)
    results[rank] = (first, second)
    comm.close()


def test_every_rank_gets_the_same_sum_and_rank_0_the_gather():
    results = run_two_ranks(_sum_and_gather)
    for dtype in (torch.float32, torch.bfloat16):
        expected = rank_partial(0, (300, 7), dtype) + rank_partial(1, (300, 7), dtype)
        for rank in (0, 1):
            assert torch.equal(results[rank][0][str(dtype)], expected), (rank, dtype)
    for rank in (0, 1):
        assert torch.equal(results[rank][1], rank_partial(0, (1, 5)) + rank_partial(1, (1, 5)))
        assert results[rank][3] == []  # rank 0 unlinked the name once both had mapped the segment
        assert results[rank][4] == 4  # every eager collective is counted, chunks or not
    assert torch.equal(results[0][2], torch.tensor([[0.0, 0, 0, 1, 1, 1]] * 2))
    assert results[1][2] is None


def test_a_dead_peer_ends_the_wait_with_collective_error():
    message, waited_s = run_two_ranks(_peer_dies, a_rank_exits=True)[0]
    assert "rank 1 died" in message
    assert waited_s < 5.0  # the liveness test runs every 10 ms of waiting


def test_a_peer_that_fails_its_part_of_a_step_ends_the_wait_at_once():
    """Without abandonment rank 0 would wait out TIMEOUT_S (30 min) for a live rank 1 that raised."""
    results = run_two_ranks(_peer_fails)
    outcomes, waited_s, abandoned = results[0]
    assert outcomes[0] == "CollectiveError: shm collective failed: rank 1 failed its part of the step (collective 2)"
    assert outcomes[1].startswith("CollectiveError: shm collective refused: rank 0 abandoned its group")
    assert waited_s < 5.0 and abandoned  # rank 0 failed in turn, abandoning too
    assert results[1][0] == ["ValueError: a bad step delta"] * 2 and results[1][2]


def test_a_peer_that_abandons_right_after_publishing_still_counts_as_arrived():
    """Found by CI: rank 1 had published and abandoned before rank 0 looked, and rank 0 failed a
    collective whose data was all there."""
    first, second = run_two_ranks(_peer_abandons_right_after_publishing)[0]
    assert torch.equal(first, torch.full((4,), 3.0))
    assert second == "shm collective failed: rank 1 failed its part of the step (collective 2)"


def test_shm_is_one_of_the_backends():
    with pytest.raises(ValueError, match="unknown collective backend 'shared'; use one of local, gloo, shm, nccl"):
        make_communicator(CommInit("shared", 0, 2))


def test_a_host_without_x86_store_order_is_refused_before_joining(monkeypatch):
    """The slots' safety rests on x86-64 store order (module docstring): elsewhere auto keeps gloo,
    and an explicit shm is refused, naming the option, before any rank joins a group."""
    from warpspec.workers.distributed import shm_comm

    monkeypatch.setattr(shm_comm.platform, "machine", lambda: "aarch64")
    assert not shm_comm.shared_memory_available()
    with pytest.raises(ValueError, match="comm_backend='shm' needs an x86-64 host with /dev/shm; this is aarch64"):
        shm_comm.SharedMemoryCommunicator(CommInit("shm", 0, 2))


def test_more_ranks_than_the_flags_hold_are_refused():
    from warpspec.workers.distributed.shm_comm import MAX_RANKS, SharedMemoryCommunicator

    with pytest.raises(ValueError, match=f"comm_backend='shm' serves at most {MAX_RANKS} ranks, not 65"):
        SharedMemoryCommunicator(CommInit("shm", 0, 65))
