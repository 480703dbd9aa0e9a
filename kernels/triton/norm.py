"""Fused residual add + RMSNorm and plain RMSNorm: one program per row, the whole row in registers
(hidden 5120 -> an 8192-wide block), float32 inside, rounded like the reference: the sum is rounded
to the stream's dtype before it is normalised, the normalised row before it meets the weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(x2)
    new_residual = torch.empty_like(x2) if residual is not None else out
    residual2 = residual.reshape(-1, hidden).contiguous() if residual is not None else x2
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        # A whole 8192-wide row over 4 warps would be 64 values per thread: spread wide rows further.
        _add_rms_norm_kernel[(x2.shape[0],)](x2, residual2, weight, out, new_residual, hidden, eps,
                                             HAS_RESIDUAL=residual is not None, BLOCK=block,
                                             num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4)
    return out.view(x.shape), new_residual.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)
