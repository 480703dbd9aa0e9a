"""Per-row FP8 (e4m3) quantization: one program per row, two passes over it (the row's amax, then
the scaled, rounded values). Same signature and bits as kernels.fp8.quantize_fp8_reference.

Rounding is done in float32 before the cast: values are first rounded to the e4m3 grid
(round-to-nearest-even: 3 mantissa bits for normals, multiples of 2^-9 below 2^-6), so the cast
only ever sees exactly representable values. The GPU's own conversion would round the same way,
but Triton's interpreter rounds wrongly whenever the mantissa carries into the exponent (measured:
31.76 -> 16 instead of 32), and the tests run this kernel under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpspec.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_AMAX

BLOCK_MAX = 4096


@triton.jit
def _round_to_e4m3(x):
    """float32 in [-448, 448] -> the nearest e4m3 value (ties to even), still float32."""
    # Below e4m3's smallest normal (2^-6) the grid is uniform, 2^-9 apart: round x * 2^9 to an
    # integer by the 1.5 * 2^23 trick (exact for |x * 2^9| < 2^22).
    subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
    # Normals keep 3 of float32's 23 mantissa bits: add just under half of the dropped 20 bits' unit
    # plus the lowest kept bit (ties to even), then clear them.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = bits.to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, n, scale_ub, min_amax, fp8_max,
                              HAS_UB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        mask = start + cols < n
        x = tl.load(x_ptr + row * n + start + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_amax = tl.maximum(tl.max(amax, axis=0), min_amax)
    if HAS_UB:
        row_amax = tl.minimum(row_amax, scale_ub)
    # Correctly rounded divisions (a GPU's default is approximate), to match torch's bits.
    inv_scale = tl.div_rn(fp8_max, row_amax)
    for start in range(0, n, BLOCK):
        mask = start + cols < n
        x = tl.load(x_ptr + row * n + start + cols, mask=mask, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(x * inv_scale, -fp8_max), fp8_max)
        tl.store(q_ptr + row * n + start + cols, _round_to_e4m3(scaled).to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row, tl.div_rn(1.0, inv_scale))


def quantize_fp8_triton(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q [..., n] float8_e4m3fn, scale [...] float32); see quantize_fp8."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    q = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0] and n:
        _quantize_fp8_rows_kernel[(x2.shape[0],)](
            x2, q, scale, n, float(scale_ub or 0.0), MIN_AMAX, FP8_MAX,
            HAS_UB=scale_ub is not None, BLOCK=min(triton.next_power_of_2(n), BLOCK_MAX))
    return q.view(x.shape), scale.view(x.shape[:-1])
