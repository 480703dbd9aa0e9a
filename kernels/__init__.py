"""Compute kernels. Every op has a plain torch reference and a Triton version with the same
signature (kernels/triton/); `dispatch.use_triton` picks Triton for CUDA tensors."""

from warpspec.kernels import batch_invariant
from warpspec.kernels.attention import paged_attention, write_kv_cache
from warpspec.kernels.attention_metadata import PagedAttentionMetadata
from warpspec.kernels.moe import moe_experts, route_topk_sigmoid
from warpspec.kernels.norm import add_rms_norm, l2_norm, rms_norm
from warpspec.kernels.rope import apply_rope_interleaved, rope_qk_norm

__all__ = [
    "PagedAttentionMetadata",
    "add_rms_norm",
    "apply_rope_interleaved",
    "batch_invariant",
    "l2_norm",
    "moe_experts",
    "paged_attention",
    "rms_norm",
    "rope_qk_norm",
    "route_topk_sigmoid",
    "write_kv_cache",
]
