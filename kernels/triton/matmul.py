"""The linear layer of deterministic mode on GPUs: y = x @ W.T with every output row summed in the
same order at any batch size.

cuBLAS picks its algorithm by shape, splitting K across thread blocks for small batches, so a row's
sum depends on how many rows came with it. This kernel has one tile shape for every call and never
splits K: the program for an output tile walks K in BLOCK_K steps from 0 to K, and each row of the
tile is reduced by the same instructions wherever it sits. The price is the tuning cuBLAS does per
shape (see `warpspec bench deterministic`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One shape for every call: a per-shape choice would bring back the dependence on the batch.
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, num_rows, out_features, in_features,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row, is_col = rows < num_rows, cols < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        is_k = ks < in_features
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * in_features + ks[None, :],
                    mask=is_row[:, None] & is_k[None, :], other=0.0)
        # W is [out, in]: the [BLOCK_K, BLOCK_N] tile of W.T is column block `cols` of W's rows.
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * in_features + ks[:, None],
                    mask=is_k[:, None] & is_col[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_features + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T -> [..., out] in x's dtype (weight converted to it first, as
    a dequantized FP8 weight arrives)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.to(x.dtype).contiguous()
    num_rows, in_features = x2.shape
    out_features = weight.shape[0]
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
        _linear_kernel[grid](x2, weight, out, num_rows, out_features, in_features, BLOCK_M=BLOCK_M,
                             BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             DOT_FP32=x.dtype == torch.float32 or not x.is_cuda)
    return out.reshape(*x.shape[:-1], out_features)
