"""FP8 (e4m3) weights with per-output-channel scales, and the linear layer that uses them.

A row r of a weight W [out, in] is stored as W_fp8[r] = round_e4m3(W[r] * 448 / amax(|W[r]|)) with
scale[r] = amax(|W[r]|) / 448, so that W[r] ~= float(W_fp8[r]) * scale[r]: the largest entry of every
row lands on e4m3's largest finite value, 448. This is fbgemm's `quantize_fp8_per_row`, the format of
Meta's FP8 Llama 4 checkpoints, and the same function quantizes activations per token on the GPU.

`fp8_linear` runs `torch._scaled_mm` (FP8 tensor cores, activations quantized per token on the fly)
on GPUs that have FP8 (compute capability 8.9 and up: Ada, Hopper, Blackwell); elsewhere it
dequantizes the weight to the activations' dtype and runs an ordinary matmul (weight-only FP8).
"""

from __future__ import annotations

import functools

import torch

from warpspec.kernels import batch_invariant
from warpspec.kernels.dispatch import use_triton
from warpspec.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_AMAX


def quantize_fp8(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 quantization over the last dim: x [..., n] -> (q [..., n] float8_e4m3fn,
    scale [...] float32) with x ~= float(q) * scale[..., None].

    scale_ub caps a row's amax (Meta's `activation_scale_ub` for activations): entries beyond the
    cap saturate at +-448 instead of flattening the rest of the row."""
    if use_triton(x):
        from warpspec.kernels.triton.fp8 import quantize_fp8_triton

        return quantize_fp8_triton(x, scale_ub)
    return quantize_fp8_reference(x, scale_ub)


def quantize_fp8_reference(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    amax = x.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    # Multiply by the reciprocal and store its inverse, as fbgemm does. Tensor / tensor divisions:
    # `448.0 / amax` would be computed as 448 * (1 / amax), one rounding more, and differ from the
    # Triton kernel's correctly rounded division in the last bit.
    inv_scale = torch.full_like(amax, FP8_MAX) / amax
    q = (x * inv_scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, torch.ones_like(inv_scale) / inv_scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., n] float8_e4m3fn, scale [...] -> float(q) * scale[..., None] in dtype."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantize_fp8_columns(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of weights stored input-major, [..., in, out] (the MoE experts'
    layout): scales over the input dim (-2). w -> (q [..., in, out], scale [..., out])."""
    q, scale = quantize_fp8(w.transpose(-1, -2).contiguous())
    return q.transpose(-1, -2).contiguous(), scale


@functools.cache
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when fp8_linear on x takes the FP8 tensor-core path. _scaled_mm wants both matrix dims
    of the weight to be multiples of 16."""
    out_features, in_features = weight.shape
    return (x.is_cuda and _has_fp8_tensor_cores(x.device) and in_features % 16 == 0 and out_features % 16 == 0)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               activation_scale_ub: float | None = None) -> torch.Tensor:
    """y = x @ W.T with W = float(weight) * weight_scale[:, None].

    x [..., in] (float32, bfloat16 or float16); weight [out, in] float8_e4m3fn; weight_scale [out]
    float32 -> y [..., out] in x's dtype."""
    if not uses_scaled_mm(x, weight) or batch_invariant.is_enabled():  # cuBLASLt picks kernels by shape
        return fp8_linear_reference(x, weight, weight_scale)
    x2 = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = quantize_fp8(x2, activation_scale_ub)
    # Row-wise scaled _scaled_mm produces bf16; other activation dtypes are cast back.
    y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale[:, None].contiguous(),
                         scale_b=weight_scale.float()[None, :].contiguous(), out_dtype=torch.bfloat16)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Weight-only FP8: dequantize to the activations' dtype, then an ordinary matmul."""
    return batch_invariant.linear(x, dequantize_fp8(weight, weight_scale, x.dtype))
