"""Rotary position embedding in Llama 4's interleaved form: adjacent dims (2i, 2i+1) form one complex
number that is rotated, unlike the rotate_half form of Llama 2/3. Scout-style layers then apply a
weightless RMSNorm to q and k (QK-norm); `rope_qk_norm` does both in one pass (one Triton launch for
q and k together on CUDA tensors)."""

import torch

from warpspec.kernels.dispatch import use_triton
from warpspec.kernels.norm import l2_norm


def apply_rope_interleaved(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; freqs_cis: [num_tokens, head_dim // 2] complex64
    (complex128 in deterministic mode, workers/rope.rope_freqs_cis), or the same rotations as real
    (cos, sin) pairs [num_tokens, head_dim // 2, 2] in a compiled step."""
    if not freqs_cis.is_complex():  # (x0 + i x1)(cos + i sin), written out
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        cos, sin = freqs_cis[:, None, :, 0], freqs_cis[:, None, :, 1]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)
    float_type = torch.float64 if freqs_cis.dtype == torch.complex128 else torch.float32
    x_complex = torch.view_as_complex(x.to(float_type).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_complex * freqs_cis[:, None, :]).flatten(-2).type_as(x)


def rope_qk_norm(q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor,
                 eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [num_tokens, heads, head_dim] and k [num_tokens, kv_heads, head_dim], then the L2
    QK-norm when eps is given (None: RoPE only)."""
    if use_triton(q):
        from warpspec.kernels.triton.rope import rope_qk_norm_triton

        return rope_qk_norm_triton(q, k, freqs_cis, eps)
    return rope_qk_norm_reference(q, k, freqs_cis, eps)


def rope_qk_norm_reference(q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor,
                           eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = apply_rope_interleaved(q, freqs_cis), apply_rope_interleaved(k, freqs_cis)
    if eps is not None:
        q, k = l2_norm(q, eps), l2_norm(k, eps)
    return q, k
