"""A compiled step's collectives: two custom ops that call a communicator's own exchange.

A compiled step (workers/compile/compiled_step.py) must meet its peers inside the graph, or the compiler
splits the graph at every collective (measured on the bundled pair over 2 workers, with the
torch.distributed calls: 114 s to compile and 0.64x the eager speed). torch's functional collectives
would stay in the graph, but inductor's C++ wrapper (compiled_step.INDUCTOR_PATCHES) cannot call them
on the CPU ("arg type Any is not yet supported by custom_op_wrapper"). A custom op is one opaque call
the C++ wrapper can make, whatever the backend behind it: gloo's TCP or shm_comm's shared memory.

Ops cannot take a communicator, so each one that registers gets a group id (an int the op can carry)
and the ops look it up. A failure inside raises from the op when the step runs; the runner turns it
into CollectiveError as for an eager step.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch


class Exchange(Protocol):
    """What the ops call: a communicator's own exchange (comm.Communicator and its backends)."""

    rank: int
    world_size: int
    reduces_in_place: bool  # exchange_sum sums into its argument

    def exchange_sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def exchange_gather(self, x: torch.Tensor) -> list[torch.Tensor] | None: ...


_groups: dict[int, Exchange] = {}


def register(comm: Exchange) -> int:
    """A group id for comm's traced collectives, the smallest free one; `unregister` it when the
    communicator closes. A compiled step holds its group id as a constant, which its guards check
    (step_artifacts.py): a rank's communicator built again in the same process after the first
    closed gets the id of the first, and so still loads its saved steps."""
    group_id = next(i for i in itertools.count() if i not in _groups)
    _groups[group_id] = comm
    return group_id


def unregister(group_id: int) -> None:
    _groups.pop(group_id, None)


def all_reduce(x: torch.Tensor, group_id: int) -> torch.Tensor:
    return torch.ops.warpspec.all_reduce(x, group_id)


def gather(x: torch.Tensor, group_id: int, dim: int) -> torch.Tensor | None:
    """Every rank's x concatenated along dim on rank 0; None on the other ranks."""
    gathered = torch.ops.warpspec.gather(x, group_id, dim)
    return gathered if _groups[group_id].rank == 0 else None


@torch.library.custom_op("warpspec::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group_id: int) -> torch.Tensor:
    comm = _groups[group_id]
    # The op may not change its input: a backend that sums into its argument gets a copy.
    return comm.exchange_sum(x.clone(memory_format=torch.contiguous_format) if comm.reduces_in_place
                            else x.contiguous())


@_all_reduce.register_fake
def _(x: torch.Tensor, group_id: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("warpspec::gather", mutates_args=())
def _gather(x: torch.Tensor, group_id: int, dim: int) -> torch.Tensor:
    """Ranks past 0 get an unfilled tensor of the gathered shape (an op's shape must not depend on the
    rank) and drop it."""
    comm = _groups[group_id]
    parts = comm.exchange_gather(x.contiguous())
    if parts is None:
        return _gathered_like(x, comm.world_size, dim)
    return torch.cat(parts, dim=dim)


@_gather.register_fake
def _(x: torch.Tensor, group_id: int, dim: int) -> torch.Tensor:
    return _gathered_like(x, _groups[group_id].world_size, dim)


# A rank past 0 drops the gather's result, and a pure op whose result goes unused is removed from the
# graph: that rank would skip the exchange and leave rank 0 waiting. Every rank must take part.
for _op in (torch.ops.warpspec.all_reduce.default, torch.ops.warpspec.gather.default):
    torch.fx.node.has_side_effect(_op)


def _gathered_like(x: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)
