"""Interleaved RoPE fused with the optional L2 QK-norm. One program per (token, head) over q's heads
then k's: the even and odd dims of the head are loaded as two half-width vectors, rotated as complex
pairs (a + ib) * (cos + i sin), rounded to the dtype as the reference does, then normalised."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_qk_norm_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, freqs_ptr, num_q_heads, num_k_heads, eps,
                         HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pairs = tl.arange(0, HALF)
    # freqs_cis viewed as real: [num_tokens, HALF, 2] = (cos, sin) per pair.
    cos = tl.load(freqs_ptr + token * HALF * 2 + pairs * 2)
    sin = tl.load(freqs_ptr + token * HALF * 2 + pairs * 2 + 1)
    if head < num_q_heads:
        base = (token * num_q_heads + head) * HALF * 2
        src, dst = q_ptr + base, q_out_ptr + base
    else:
        base = (token * num_k_heads + head - num_q_heads) * HALF * 2
        src, dst = k_ptr + base, k_out_ptr + base
    even = tl.load(src + pairs * 2).to(tl.float32)
    odd = tl.load(src + pairs * 2 + 1).to(tl.float32)
    out_even = (even * cos - odd * sin).to(dst.dtype.element_ty).to(tl.float32)
    out_odd = (even * sin + odd * cos).to(dst.dtype.element_ty).to(tl.float32)
    if HAS_NORM:
        mean_square = (tl.sum(out_even * out_even, axis=0) + tl.sum(out_odd * out_odd, axis=0)) / (2 * HALF)
        rstd = 1.0 / tl.sqrt(mean_square + eps)
        out_even, out_odd = out_even * rstd, out_odd * rstd
    tl.store(dst + pairs * 2, out_even.to(dst.dtype.element_ty))
    tl.store(dst + pairs * 2 + 1, out_odd.to(dst.dtype.element_ty))


def rope_qk_norm_triton(q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor,
                        eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"rope_qk_norm_triton needs a power-of-two head_dim, got {head_dim}")
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    freqs = torch.view_as_real(freqs_cis.to(torch.complex64)).contiguous()
    if num_tokens:
        _rope_qk_norm_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q, k, q_out, k_out, freqs, num_q_heads, k.shape[1], eps if eps is not None else 0.0,
            HALF=half, HAS_NORM=eps is not None)
    return q_out, k_out
