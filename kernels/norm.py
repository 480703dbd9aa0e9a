"""RMSNorm and its fused residual form, rounded exactly as transformers' Llama4TextRMSNorm:
normalise in float32, cast back to the input dtype, then scale by the weight in that dtype."""

import torch
import torch.nn.functional as F


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm (Llama 4's QK-norm), x * rsqrt(mean(x^2) + eps) in float32. [..., dim]"""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return l2_norm(x, eps) * weight


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) with new_residual = residual + x. [num_tokens, hidden] each.

    The sharded path puts the all-reduce of `x` in front of this (one fused collective)."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual
