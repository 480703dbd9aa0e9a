"""Collectives among the ranks of one model replica, behind one small interface.

Backends: `local` (one rank, nothing to exchange), `gloo` (torch.distributed over TCP, for CPUs),
`shm` (CPU ranks on one host, through shared memory: workers/distributed/shm_comm.py) and `nccl` (NCCL through
CuPy, for GPUs; the unique id is made on rank 0 and handed to every rank by the coordinator). The
model reduces only through `allreduce_residual_rmsnorm`, so a backend can fuse the reduction with the
residual add and the norm.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from warpspec.kernels import add_rms_norm, batch_invariant, rms_norm
from warpspec.workers.distributed import traced_collectives


@dataclass
class CommInit:
    """How rank `rank` of `world_size` joins its group (typed, it crosses the actor boundary)."""

    backend: str
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"  # gloo and shm: rank 0's address and a free port there
    master_port: int = 0
    nccl_unique_id: bytes = b""  # nccl: made by rank 0 with make_nccl_unique_id()


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died or became unreachable. The group cannot be used again."""


@contextlib.contextmanager
def collective_failures(backend: str):
    """Turn a backend's failure inside a collective (gloo: "Connection closed by peer", NCCL errors)
    into CollectiveError, so the coordinator tells a broken replica from a bad request."""
    try:
        yield
    except (NotImplementedError, CollectiveError):
        raise
    except RuntimeError as e:
        raise CollectiveError(f"{backend} collective failed: {str(e).splitlines()[0][:300]}") from None


class Communicator:
    # Whether a compiled step can call this backend's collectives (_traced_all_reduce, _traced_gather).
    has_traced_collectives = False
    # Whether exchange_sum sums into its argument (and returns it) rather than into a new tensor.
    reduces_in_place = True

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank = rank
        self.world_size = world_size
        self.num_collectives = 0  # counted so tests can hold the decode path to its budget
        self.abandoned = False  # this rank left a step part-way (failing_together)

    def __getstate__(self) -> dict:
        """Its numbers only (rank, world size, group id): saving a compiled step whole pickles what its
        arguments reach (step_artifacts.py), the model and so its communicator among them, whose
        process group and shared memory do not pickle. The step's guards check the numbers it read
        on the live communicator of the process that loads it."""
        return {name: value for name, value in vars(self).items() if type(value) in (int, bool, float, str)}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns the reduced tensor (possibly x itself, reduced in place)."""
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return self._traced_all_reduce(x)
        self.num_collectives += 1
        with collective_failures(type(self).__name__):
            if batch_invariant.is_enabled() and x.dtype != torch.float64:
                # Ring and tree all-reduces chunk by message size, so the order in which an element
                # sums the ranks depends on the batch; world_size bf16 partials sum exactly in float64.
                return self.exchange_sum(x.double().contiguous()).to(x.dtype)
            return self.exchange_sum(x.contiguous())

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's x along dim on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return self._traced_gather(x, dim)
        self.num_collectives += 1
        with collective_failures(type(self).__name__):
            parts = self.exchange_gather(x.contiguous())
        return torch.cat(parts, dim=dim) if parts is not None else None

    def allreduce_residual_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor | None,
                                   weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new_residual) with new_residual = residual + sum over ranks of partial.

        residual None: partial (summed) is the whole stream, as for the vocab-parallel embedding."""
        reduced = self.all_reduce(partial)
        if residual is None:
            return rms_norm(reduced, weight, eps), reduced
        return add_rms_norm(reduced, residual, weight, eps)

    @contextlib.contextmanager
    def failing_together(self):
        """Run one rank's part of a step; if it raises, this rank abandons the group first (abandon),
        so that peers waiting for it in a collective fail too instead of waiting out the timeout. The
        ranks' collectives no longer pair up after that: the group must be rebuilt."""
        try:
            yield
        except BaseException:
            if self.world_size > 1:
                self.abandoned = True
                self.abandon()
            raise

    def abandon(self) -> None:
        """Tell the peers this rank will not arrive. Gloo has no way to: its peers wait out gloo's
        timeout (SharedMemoryCommunicator can)."""

    def close(self) -> None:
        pass

    # The backend's exchange, unchecked and uncounted: all_reduce and gather call it (and so do the
    # traced ops of a compiled step, traced_collectives.py). The base class is the one-rank
    # communicator, whose all_reduce and gather return before reaching these; multi-rank backends
    # implement them.
    def exchange_sum(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no collective for {self.world_size} ranks")

    def exchange_gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        raise NotImplementedError(f"{type(self).__name__} has no collective for {self.world_size} ranks")

    # Inside a compiled step (workers/compile/compiled_step.py): collectives the compiler traces, so that a
    # step of several ranks stays one graph. A failure surfaces when the step runs, where the runner
    # turns it into CollectiveError; the collectives of a compiled step are not counted.
    def _traced_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no compiled collectives")

    def _traced_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        raise NotImplementedError(f"{type(self).__name__} has no compiled collectives")


class GlooCommunicator(Communicator):
    has_traced_collectives = True

    def __init__(self, init: CommInit):
        import torch.distributed as dist

        super().__init__(init.rank, init.world_size)
        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://{init.master_addr}:{init.master_port}",
                                rank=init.rank, world_size=init.world_size)
        self.group_id = traced_collectives.register(self)

    def exchange_sum(self, x: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(x)
        return x

    def exchange_gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        self.dist.gather(x, parts, dst=0)
        return parts

    def _traced_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return traced_collectives.all_reduce(x, self.group_id)

    def _traced_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        return traced_collectives.gather(x, self.group_id, dim)

    def close(self) -> None:
        traced_collectives.unregister(self.group_id)
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def make_nccl_unique_id() -> bytes:
    from cupy.cuda import nccl

    # CuPy hands the id out as a tuple of signed chars.
    return bytes(b & 0xFF for b in nccl.get_unique_id())


class NcclCommunicator(Communicator):
    """NCCL through CuPy on the current CUDA stream of torch. Needs a GPU and the NCCL library."""

    def __init__(self, init: CommInit):
        from cupy.cuda import nccl

        super().__init__(init.rank, init.world_size)
        self.nccl = nccl
        unique_id = tuple(int(b) if b < 128 else int(b) - 256 for b in init.nccl_unique_id)
        self.comm = nccl.NcclCommunicator(init.world_size, unique_id, init.rank)
        self.dtypes = {torch.float64: nccl.NCCL_FLOAT64, torch.float32: nccl.NCCL_FLOAT32,
                       torch.float16: nccl.NCCL_FLOAT16, torch.bfloat16: nccl.NCCL_BFLOAT16}

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def exchange_sum(self, x: torch.Tensor) -> torch.Tensor:
        self.comm.allReduce(x.data_ptr(), x.data_ptr(), x.numel(), self.dtypes[x.dtype], self.nccl.NCCL_SUM,
                            self._stream())
        return x

    def exchange_gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        # NCCL has no gather; all-gather and let rank 0 keep the result.
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        self.comm.allGather(x.data_ptr(), out.data_ptr(), x.numel(), self.dtypes[x.dtype], self._stream())
        return list(out.unbind(0)) if self.rank == 0 else None

    def close(self) -> None:
        self.comm.destroy()
