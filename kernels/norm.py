"""RMSNorm and its fused residual form, rounded exactly as transformers' Llama4TextRMSNorm:
normalise in float32, cast back to the input dtype, then scale by the weight in that dtype.

Each op dispatches to its Triton version on CUDA tensors (kernels/triton/norm.py)."""

import torch
import torch.nn.functional as F

from warpspec.kernels.batch_invariant import float_dtype
from warpspec.kernels.dispatch import use_triton


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm (Llama 4's QK-norm), x * rsqrt(mean(x^2) + eps) in float32 (float64 in
    deterministic mode). [..., dim]"""
    return F.rms_norm(x.to(float_dtype(x)), (x.shape[-1],), eps=eps).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from warpspec.kernels.triton.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) with new_residual = residual + x. [num_tokens, hidden] each.

    The sharded path puts the all-reduce of `x` in front of this (one fused collective)."""
    if use_triton(x):
        from warpspec.kernels.triton.norm import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return l2_norm(x, eps) * weight


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps), new_residual
