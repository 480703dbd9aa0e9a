"""Rotary position embedding in Llama 4's interleaved form: adjacent dims (2i, 2i+1) form one complex
number that is rotated, unlike the rotate_half form of Llama 2/3."""

import torch


def apply_rope_interleaved(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; freqs_cis: [num_tokens, head_dim // 2] complex64."""
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_complex * freqs_cis[:, None, :]).flatten(-2).type_as(x)
