"""FP8 e4m3 quantization with per-row scales, the Triton kernel against its reference (under the
Triton interpreter, TRITON_INTERPRET=1 from tests/conftest.py), and the FP8 linear.

Tolerances: the Triton kernel rounds to the e4m3 grid in float32 exactly as torch's cast does, so
quantized values and scales must agree bit for bit, for float32, bfloat16 and float16 inputs alike.
Against the unquantized values, e4m3 keeps 3 mantissa bits: a value's error is at most half a unit
of its last place, |x| * 2^-4, or half the subnormal spacing (2^-10 in units of the scale) near zero.
"""

from __future__ import annotations

import pytest
import torch

from warpspec.kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_linear,
    quantize_fp8,
    quantize_fp8_columns,
    quantize_fp8_reference,
    uses_scaled_mm,
)

triton = pytest.importorskip("triton")

from warpspec.kernels.triton.fp8 import BLOCK_MAX, quantize_fp8_triton  # noqa: E402


def error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (5, 80), (3, BLOCK_MAX + 904), (2, 3, 33)])
def test_triton_quantize_matches_reference_bitwise(dtype, shape):
    """80: a row that is not a power of 2; BLOCK_MAX + 904: a row read in two blocks, the second
    ragged; (2, 3, 33): leading dims flattened and restored."""
    gen = torch.Generator().manual_seed(shape[-1])
    # Rows of very different magnitudes, so each row's scale matters.
    x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-2])[:, None]).to(dtype)
    q, scale = quantize_fp8_triton(x)
    q_ref, scale_ref = quantize_fp8_reference(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_triton_quantize_every_e4m3_value_and_every_tie():
    """All 253 finite e4m3 values and the midpoints between neighbours (ties round to even), in one
    row whose amax is 448, so the scale is 1 and the row is rounded as given."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[~grid.isnan()].sort().values.unique()
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])[None, :]
    q, scale = quantize_fp8_triton(x)
    q_ref, scale_ref = quantize_fp8_reference(x)
    assert scale.item() == scale_ref.item() == 1.0
    torch.testing.assert_close(q.float(), q_ref.float(), atol=0, rtol=0)
    torch.testing.assert_close(q.float()[0, : grid.numel()], grid, atol=0, rtol=0)


def test_zero_rows_and_scale_upper_bound():
    x = torch.zeros(3, 32)
    x[1, 0] = 10_000.0  # an outlier: with a cap of 1200 the row's other entries keep their precision
    x[1, 1:] = torch.linspace(-3, 3, 31)
    x[2] = torch.linspace(-1, 1, 32)
    for quantize in (quantize_fp8_triton, quantize_fp8_reference):
        q, scale = quantize(x, scale_ub=1200.0)
        assert torch.equal(q[0].float(), torch.zeros(32))  # all-zero row: no NaN from a zero scale
        assert scale[1].item() == pytest.approx(1200.0 / 448.0)
        assert q[1, 0].float().item() == 448.0  # saturates instead of overflowing to NaN
        err = (dequantize_fp8(q, scale) - x)[1, 1:].abs()
        assert torch.all(err <= error_bound(x[1, 1:], scale[1]))
    q_ref, scale_ref = quantize_fp8_reference(x, scale_ub=1200.0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_error_within_half_an_e4m3_ulp(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 200, generator=gen) * torch.rand(64, 1, generator=gen) * 10).to(dtype)
    q, scale = quantize_fp8(x)
    torch.testing.assert_close(scale, x.float().abs().amax(-1) / 448.0)  # a row's largest entry -> 448
    err = (dequantize_fp8(q, scale) - x.float()).abs()
    assert torch.all(err <= error_bound(x.float(), scale))


def test_quantize_columns_is_per_output_channel():
    """Experts' [E, in, out] layout: each output column gets its own scale, over the input dim."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 40, 24, generator=gen) * torch.logspace(-2, 2, 24)  # columns of very different size
    q, scale = quantize_fp8_columns(w)
    assert q.shape == (3, 40, 24) and scale.shape == (3, 24)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 448.0)
    deq = q.float() * scale[:, None, :]
    assert torch.all((deq - w).abs() <= error_bound(w.transpose(1, 2), scale).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_reference_is_dequantize_then_matmul(dtype):
    """On CPU, fp8_linear is weight-only FP8: y = x @ (float(W_fp8) * scale).T in x's dtype."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 7, 32, generator=gen).to(dtype)
    w = torch.randn(48, 32, generator=gen) * 0.05
    q, scale = quantize_fp8(w)
    assert not uses_scaled_mm(x, q)
    y = fp8_linear(x, q, scale)
    assert y.dtype == dtype and y.shape == (4, 7, 48)
    expected = x @ dequantize_fp8(q, scale, dtype).T
    torch.testing.assert_close(y, expected, atol=0, rtol=0)
    # And close to the unquantized product: each weight is within 2^-4 relative of its original.
    unquantized = x.float() @ w.T
    relative = (y.float() - unquantized).norm() / unquantized.norm()
    assert relative < 0.04
