"""Deterministic mode: every row of a step computed to the same bits, whatever else the step holds.

Why a row depends on its batch at all: a kernel picks its blocking, its split of a reduction and its
vector path from the shapes it is given. The same row in a batch of 1, of 37, or as one of k+1
verification positions, is summed in a different order. In bf16 one different rounding can flip an
argmax, and the rest of a greedy output drifts from there.

How each path gets there:
- CPU (the torch references): oneDNN and MKL choose kernels by shape and CPU, and no API fixes their
  order of summation. So the order is made irrelevant instead: while the mode is on, every op that
  reduces, or calls a transcendental function, computes in float64, and its output is rounded once
  to the serving dtype. A bf16 x bf16 product (8-bit significands) is exact in float64 (53 bits),
  and a sum of K of them is exact in ANY order as long as its terms span less than
  2^(37 - log2 K) in magnitude. Beyond that span, two orders differ by a few float64 ulps, and that
  difference changes the rounded bf16 value only when it falls within about 2^-40 (relative) of a
  bf16 rounding boundary. Float16 has even more room. Float32 inputs leave float64 only 5 bits of
  headroom, so for float32 the mode is only very likely exact, not exact by construction.
  The cost: a float64 copy of each weight (made on first use, kept on the weight), and float64
  arithmetic.
- CUDA (Triton): the kernels are batch-invariant by construction. Tiles of fixed shape, no split of
  a reduction that depends on the batch: the linear layers run `kernels/triton/matmul.py` instead of
  cuBLAS, attention walks each query's context in one program, and the all-reduce sums in float64.

The mode is a switch for the current process, set around each step by whoever runs the model
(`deterministic(True)`), so the model code stays the same in both modes. Being process-wide, it
assumes one engine steps at a time in a process (as every engine here does: one step loop each);
two engines with different settings stepping in two threads of one process would mix them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from warpspec.kernels.dispatch import use_triton

_enabled = False


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Run the enclosed steps in deterministic mode (or not, with enabled=False); restores the previous
    setting on exit."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def is_enabled() -> bool:
    return _enabled


def float_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an op on x does its float work in (normalisation, softmax, RoPE rotations, routing
    scores): float64 in deterministic mode when the torch reference runs the op, float32 otherwise
    (the Triton kernels keep float32, and are invariant by their fixed tiles)."""
    return torch.float64 if _enabled and not use_triton(x) else torch.float32


def float64_copy(weight: torch.Tensor) -> torch.Tensor:
    """weight in float64, converted once and kept on the tensor (serving weights never change after
    loading; a tensor whose values do change must not go through here)."""
    copy = getattr(weight, "_float64_copy", None)
    if copy is None or copy.shape != weight.shape:
        copy = weight.detach().double()
        weight._float64_copy = copy
    return copy


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype; batch-invariant in deterministic mode. weight [out, in]."""
    if not _enabled:
        return F.linear(x, weight)
    if use_triton(x):
        from warpspec.kernels.triton.matmul import batch_invariant_linear

        return batch_invariant_linear(x, weight)
    return F.linear(x.double(), float64_copy(weight)).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up in gate's dtype (float64 inside in deterministic mode)."""
    if float_dtype(gate) != torch.float64:  # elementwise: the same bits at any batch size on a GPU
        return F.silu(gate) * up
    return (F.silu(gate.double()) * up.double()).to(gate.dtype)
