from __future__ import annotations

import torch

from warpspec.kernels import add_rms_norm, apply_rope_interleaved, rms_norm


def test_rope_rotates_adjacent_pairs():
    """Dims (0,1) form one complex number: x = 1 + 0i at angle pi/2 becomes 0 + 1i; |x| is kept."""
    x = torch.tensor([[[1.0, 0.0, 3.0, 4.0]]])  # [tokens=1, heads=1, head_dim=4]
    angles = torch.tensor([[torch.pi / 2, 0.0]])
    out = apply_rope_interleaved(x, torch.polar(torch.ones_like(angles), angles))
    torch.testing.assert_close(out, torch.tensor([[[0.0, 1.0, 3.0, 4.0]]]), atol=1e-6, rtol=0)


def test_add_rms_norm_is_add_then_norm():
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    weight = torch.rand(8, generator=gen)
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual)
    expected = (x + residual) / ((x + residual).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight
    torch.testing.assert_close(normed, expected)
    torch.testing.assert_close(rms_norm(x + residual, weight, 1e-5), expected)


def test_real_rotation_pairs_rotate_as_the_complex_form():
    """A compiled step passes the rotations as (cos, sin) pairs: the same result as complex ones."""
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0))
    angles = torch.arange(5.0)[:, None] * torch.tensor([1.0, 0.3, 0.05, 0.001])[None, :]
    complex_form = apply_rope_interleaved(x, torch.polar(torch.ones_like(angles), angles))
    real_form = apply_rope_interleaved(x, torch.stack([angles.cos(), angles.sin()], dim=-1))
    torch.testing.assert_close(real_form, complex_form, atol=1e-6, rtol=1e-6)
    assert not torch.equal(real_form, x)  # position 0 stays, the others rotate
