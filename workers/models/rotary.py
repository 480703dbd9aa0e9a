"""RoPE frequencies for the scaling types Llama checkpoints use (default, llama3, linear), in
transformers' formulas, returned as complex rotations for the interleaved pair form."""

from __future__ import annotations

import math

import torch

from warpspec.kernels.batch_invariant import float_dtype
from warpspec.workers.model_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_freqs_cis(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """positions [num_tokens] -> [num_tokens, head_dim // 2] complex64 rotations e^(i * pos * f);
    complex128 in deterministic mode on the torch references (kernels/batch_invariant.py), where the
    cosines and sines are taken in float64 (torch's vector and scalar float32 paths can differ by an
    ulp, and which path an element takes depends on the batch's size)."""
    angles = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    angles = angles.to(float_dtype(angles))
    if torch.compiler.is_compiling():
        # Inductor generates no code for complex tensors (it would run them op by op): a compiled
        # step takes the rotations as real (cos, sin) pairs, [num_tokens, head_dim // 2, 2].
        return torch.stack([angles.cos(), angles.sin()], dim=-1)
    return torch.polar(torch.ones_like(angles), angles)
