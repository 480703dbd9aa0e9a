"""Collectives among CPU ranks on one host, through one shared-memory segment.

Over gloo a rank's all-reduce is a TCP round trip through the kernel: ~0.5 ms on this 2-core
machine for a [1, hidden] row, 14 of them a decode step of the bundled target over 2 workers. Ranks
of one replica share a host (the placement group packs them on one node), so they can exchange
through memory instead, as vLLM's CPU backend does: each rank copies its tensor into its own slot,
publishes a sequence number, waits for every peer's number, and sums the slots itself.

Layout of the segment (a file in /dev/shm, unlinked as soon as every rank has mapped it, so a killed
replica leaves nothing behind):

    [flags: 64 B per rank (its last published sequence number)] [slots: 2 parities x world x SLOT_BYTES]

Why two parities are enough: a rank writes parity p = seq % 2 again only at seq + 2, after its wait
at seq + 1, which needs every peer to have published seq + 1, which each does only after it finished
reading seq. x86-64 keeps stores in program order and never moves a load past a later store, so the
slot copy is visible before the flag that announces it, and a peer's reads of a slot are done before
its next flag. (A copy or sum that torch splits over OpenMP threads ends at the region's barrier, a
full fence, before this thread writes the flag.) Other architectures need fences Python cannot
issue: there the ranks keep gloo.

Every rank sums the slots in rank order, so every rank gets the same bits, and a row's sum does not
depend on the other rows in the batch (no chunking by message size, unlike a ring all-reduce).
Gloo stays for setting the segment up; every collective then goes through memory, in chunks of
SLOT_BYTES.

A peer that dies holds no lock on its byte of the segment any more (the kernel drops a dead
process's record locks), which a waiting rank tests now and then: the wait ends in CollectiveError,
as gloo's "Connection closed by peer" does. A peer that fails its part of a step (an exception in
`failing_together`) replaces its flag s with ~s (-s - 1: negative, and still saying it published s),
which ends a wait for anything after s in CollectiveError at once. A wait for s itself still
succeeds: the peer may abandon right after publishing s, before this rank has looked.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch

from warpspec.workers.distributed.comm import CollectiveError, CommInit, GlooCommunicator

SLOT_BYTES = 1 << 20  # per rank and parity; larger tensors go through in chunks of this size
FLAG_STRIDE = 64  # bytes: one cache line per rank's flag, so ranks publishing at once do not contend
MAX_RANKS = 64
MAX_KEPT_VIEWS = 64  # (parity, numel, dtype) views of the slots kept for reuse (_slot_views)
# Waiting for a peer: ranks of one decode step arrive within ~0.1 ms of each other, so spin first;
# then give the core away between looks; a peer still busy after some milliseconds (compiling a graph,
# or a long prompt) is waited for in short sleeps, so that the wait does not take a core from it.
SPIN_S = 100e-6
YIELD_S = 5e-3
SLEEP_S = 100e-6
LIVENESS_EVERY_S = 0.01  # while waiting, test this often whether the peers still live
TIMEOUT_S = 1800.0  # a live peer that never arrives: gloo's default timeout


def shared_memory_available() -> bool:
    """Whether this host can run SharedMemoryCommunicator (x86-64 store order, a /dev/shm)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class SharedMemoryCommunicator(GlooCommunicator):
    reduces_in_place = False  # it sums the slots into a new tensor

    def __init__(self, init: CommInit, slot_bytes: int = SLOT_BYTES):
        if not shared_memory_available():
            raise ValueError(f"comm_backend='shm' needs an x86-64 host with /dev/shm; this is "
                             f"{platform.machine()} (use comm_backend='gloo')")
        if init.world_size > MAX_RANKS:
            raise ValueError(f"comm_backend='shm' serves at most {MAX_RANKS} ranks, not {init.world_size}")
        super().__init__(init)
        self.slot_bytes = slot_bytes
        self.seq = 0
        self.fd, self.segment = self._map_segment()
        self._hold_liveness_lock()
        self._build_views()

    # ---- setup ----------------------------------------------------------------------------------

    def _map_segment(self) -> tuple[int, mmap.mmap]:
        """Rank 0 creates the file and names it to the others over gloo; every rank maps it; once all
        have, rank 0 unlinks the name (the mappings live on)."""
        size = MAX_RANKS * FLAG_STRIDE + 2 * self.world_size * self.slot_bytes
        name = [f"/dev/shm/warpspec-comm-{os.getpid()}-{secrets.token_hex(6)}" if self.rank == 0 else None]
        if self.rank == 0:
            fd = os.open(name[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        self.dist.broadcast_object_list(name, src=0)
        if self.rank != 0:
            fd = os.open(name[0], os.O_RDWR)
        segment = mmap.mmap(fd, size)
        self.dist.barrier()
        if self.rank == 0:
            os.unlink(name[0])
        return fd, segment

    def _hold_liveness_lock(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, self.rank)
        self.dist.barrier()  # every rank holds its lock before any tests another's

    def _build_views(self) -> None:
        buffer = torch.frombuffer(self.segment, dtype=torch.uint8)
        flag_bytes = MAX_RANKS * FLAG_STRIDE
        # [MAX_RANKS] int64, one per cache line; numpy reads the memory afresh on every look.
        self.flags = np.frombuffer(self.segment, dtype=np.int64, count=flag_bytes // 8)[::FLAG_STRIDE // 8]
        # [2 parities][world] of [slot_bytes] uint8
        slots = buffer[flag_bytes:].view(2, self.world_size, self.slot_bytes)
        self.slots = [list(parity.unbind(0)) for parity in slots.unbind(0)]
        self._views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}

    # ---- collectives ----------------------------------------------------------------------------

    def exchange_sum(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        out = torch.empty_like(flat)
        per_chunk = self.slot_bytes // flat.element_size()
        for start in range(0, max(flat.numel(), 1), per_chunk):
            parts = self._exchange(flat[start:start + per_chunk])
            total = out[start:start + per_chunk]
            torch.add(parts[0], parts[1], out=total)
            for part in parts[2:]:
                total.add_(part)
        return out.view(x.shape)

    def exchange_gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        flat = x.reshape(-1)
        outs = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else None
        per_chunk = self.slot_bytes // flat.element_size()
        for start in range(0, max(flat.numel(), 1), per_chunk):
            parts = self._exchange(flat[start:start + per_chunk])
            if outs is not None:
                for out, part in zip(outs, parts, strict=True):
                    out[start:start + per_chunk].copy_(part)
        return [out.view(x.shape) for out in outs] if outs is not None else None

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Publish part ([n] contiguous), wait for every rank's, and return all of them in rank order
        as views of the slots: valid until this rank's next exchange."""
        if self.abandoned:
            raise CollectiveError(f"shm collective refused: rank {self.rank} abandoned its group; "
                                  "the replica must be rebuilt")
        self.seq += 1
        views = self._slot_views(self.seq % 2, part.numel(), part.dtype)
        views[self.rank].copy_(part)
        self.flags[self.rank] = self.seq
        self._wait_for_peers()
        return views

    def _slot_views(self, parity: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot of that parity as [numel] of dtype. A decode step exchanges the same few
        shapes over and over, and making the views costs more than the copy: they are kept (a prompt's
        odd shapes clear the store when it fills)."""
        key = (parity, numel, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_KEPT_VIEWS:
                self._views.clear()
            num_bytes = numel * dtype.itemsize
            views = self._views[key] = [slot[:num_bytes].view(dtype) for slot in self.slots[parity]]
        return views

    def _wait_for_peers(self) -> None:
        seq, flags = self.seq, self.flags
        start = next_liveness = None
        for peer in range(self.world_size):
            while (flag := flags[peer]) < seq:
                if flag < 0:  # the peer abandoned the group after publishing ~flag (module docstring)
                    if ~flag >= seq:
                        break
                    raise CollectiveError(f"shm collective failed: rank {peer} failed its part of the step "
                                          f"(collective {seq})")
                now = time.perf_counter()
                if start is None:
                    start, next_liveness = now, now + LIVENESS_EVERY_S
                waited_s = now - start
                if waited_s > YIELD_S:
                    time.sleep(SLEEP_S)
                elif waited_s > SPIN_S:
                    os.sched_yield()
                if now > next_liveness:
                    self._check_alive(peer, waited_s)
                    next_liveness = now + LIVENESS_EVERY_S

    def _check_alive(self, peer: int, waited_s: float) -> None:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, peer)
        except OSError:
            if waited_s > TIMEOUT_S:
                raise CollectiveError(f"shm collective failed: rank {peer} has not arrived in "
                                      f"{waited_s:.0f} s") from None
            return  # the peer holds its lock: alive
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, peer)
        raise CollectiveError(f"shm collective failed: rank {peer} died (collective {self.seq})")

    def abandon(self) -> None:
        published = int(self.flags[self.rank])
        if published >= 0:
            self.flags[self.rank] = ~published

    def close(self) -> None:
        self.slots = self.flags = self._views = None
        with contextlib.suppress(BufferError):  # a caller still holds a view of a slot: it goes with that
            self.segment.close()
        os.close(self.fd)
        super().close()
