"""MoE on the GPU: routing, permutation, grouped expert GEMMs (bf16 or FP8 weights), combine.

The (token, expert) assignments are sorted by expert and each expert's run is padded to a multiple
of BLOCK_M rows, so every BLOCK_M-row tile of the grouped GEMM belongs to one expert and reads only
that expert's weights: with 1 token and top-1 routing one tile is busy and reads one expert; the
other tiles exit at once. The number of tiles has a bound that depends only on the shapes
(ceil(assignments / BLOCK_M) + experts), so nothing here waits on the GPU and the step can be
captured in a CUDA graph.

  expert ids per assignment [2, 0, 2], BLOCK_M 2, 3 local experts
  -> sorted_rows [1, -1 | 0, 2 | -1, -1 | ...]  (expert 0's tile, expert 2's tile, unused tiles)
     tile_expert [0, 2, -1, ...]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _route_topk_sigmoid_kernel(logits_ptr, expert_ids_ptr, scores_ptr, num_experts, TOP_K: tl.constexpr,
                               BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK)
    logits = tl.load(logits_ptr + token * num_experts + experts, mask=experts < num_experts,
                     other=float("-inf")).to(tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(logits, axis=0)
        # The lowest index among equal maxima, as torch.topk picks on CPU.
        best_id = tl.min(tl.where(logits == best, experts, BLOCK), axis=0)
        tl.store(expert_ids_ptr + token * TOP_K + j, best_id.to(tl.int64))
        tl.store(scores_ptr + token * TOP_K + j, tl.sigmoid(best).to(scores_ptr.dtype.element_ty))
        logits = tl.where(experts == best_id, float("-inf"), logits)


def route_topk_sigmoid_triton(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.contiguous()
    expert_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    scores = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    if num_tokens:
        _route_topk_sigmoid_kernel[(num_tokens,)](logits, expert_ids, scores, num_experts, TOP_K=top_k,
                                                  BLOCK=triton.next_power_of_2(num_experts))
    return expert_ids, scores


def align_by_expert(local_ids: torch.Tensor, num_local: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """local_ids [num_assignments] (outside [0, num_local): another rank's expert) ->
    (sorted_rows [num_tiles * block_m], -1 for padding; tile_expert [num_tiles], -1 for unused tiles)."""
    device = local_ids.device
    num_assignments = local_ids.shape[0]
    num_tiles = triton.cdiv(num_assignments, block_m) + num_local
    is_local = (local_ids >= 0) & (local_ids < num_local)
    keys = torch.where(is_local, local_ids, num_local)
    order = torch.argsort(keys, stable=True)
    # scatter_add, not bincount: bincount reads the largest key back to size its output (a GPU sync).
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(
        0, keys, torch.ones_like(keys))[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_keys = keys[order]
    is_sorted_local = sorted_keys < num_local
    expert_of = sorted_keys.clamp(max=num_local - 1)
    rank_in_expert = torch.arange(num_assignments, device=device) - start[expert_of]
    # Other ranks' assignments go to one spare slot past the end, dropped below.
    dest = torch.where(is_sorted_local, padded_start[expert_of] + rank_in_expert, num_tiles * block_m)
    sorted_rows = torch.full((num_tiles * block_m + 1,), -1, dtype=torch.int64, device=device)
    sorted_rows.scatter_(0, dest, order)
    tile_start = torch.arange(num_tiles, device=device) * block_m
    tile_expert = torch.searchsorted(torch.cumsum(padded, 0), tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_local, tile_expert, -1)
    return sorted_rows[:-1], tile_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, w_scale_ptr, scores_ptr, sorted_rows_ptr, tile_expert_ptr, out_ptr,
                    hidden, inter, top_k, HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[row] = silu(a @ W_gate) * (a @ W_up), a = x[token of row] * score[row], for one tile of
    BLOCK_M rows of one expert and BLOCK_N columns of the intermediate width."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= 0:
        rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        is_row = rows >= 0
        tokens = tl.where(is_row, rows // top_k, 0)
        row_scores = tl.load(scores_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        is_col = cols < inter
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        w_expert = w_ptr + expert * hidden * 2 * inter
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tokens[:, None] * hidden + ks[None, :], mask=is_row[:, None] & (ks < hidden)[None, :],
                        other=0.0).to(tl.float32)
            # The reference rounds x * score to x's dtype before the expert sees it.
            a = (a * row_scores[:, None]).to(x_ptr.dtype.element_ty)
            w_mask = (ks < hidden)[:, None] & is_col[None, :]
            w_gate = tl.load(w_expert + ks[:, None] * 2 * inter + cols[None, :], mask=w_mask, other=0.0)
            w_up = tl.load(w_expert + ks[:, None] * 2 * inter + inter + cols[None, :], mask=w_mask, other=0.0)
            if DOT_FP32:
                a32 = a.to(tl.float32)
                acc_gate += tl.dot(a32, w_gate.to(tl.float32), input_precision="ieee")
                acc_up += tl.dot(a32, w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_gate += tl.dot(a, w_gate.to(a.dtype))
                acc_up += tl.dot(a, w_up.to(a.dtype))
        if HAS_SCALE:
            scale_expert = w_scale_ptr + expert * 2 * inter
            acc_gate *= tl.load(scale_expert + cols, mask=is_col, other=0.0)[None, :]
            acc_up *= tl.load(scale_expert + inter + cols, mask=is_col, other=0.0)[None, :]
        gate = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32) * up
        tl.store(out_ptr + rows[:, None] * inter + cols[None, :], act.to(out_ptr.dtype.element_ty),
                 mask=is_row[:, None] & is_col[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, out_ptr, inter, hidden,
                 HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """out[row] = act[row] @ W_down for one tile of one expert's rows and BLOCK_N hidden columns."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= 0:
        rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        is_row = rows >= 0
        safe_rows = tl.where(is_row, rows, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        is_col = cols < hidden
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        w_expert = w_ptr + expert * inter * hidden
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + safe_rows[:, None] * inter + ks[None, :],
                        mask=is_row[:, None] & (ks < inter)[None, :], other=0.0)
            w = tl.load(w_expert + ks[:, None] * hidden + cols[None, :],
                        mask=(ks < inter)[:, None] & is_col[None, :], other=0.0)
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
        if HAS_SCALE:
            acc *= tl.load(w_scale_ptr + expert * hidden + cols, mask=is_col, other=0.0)[None, :]
        tl.store(out_ptr + safe_rows[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=is_row[:, None] & is_col[None, :])


@triton.jit
def _combine_kernel(expert_out_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[token] = sum over its k assignments (rows token*k .. token*k+k-1); the scores were
    applied to the expert inputs already, as Llama 4 does."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(expert_out_ptr + (token * TOP_K + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_experts_triton(x, gate_up_proj, down_proj, expert_ids, scores, first_expert=0, gate_up_scale=None,
                       down_scale=None) -> torch.Tensor:
    """Same contract as kernels.moe.moe_experts."""
    num_tokens, hidden = x.shape
    num_local, _, two_inter = gate_up_proj.shape
    inter, top_k = two_inter // 2, expert_ids.shape[1]
    x = x.contiguous()
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    sorted_rows, tile_expert = align_by_expert(expert_ids.reshape(-1) - first_expert, num_local, BLOCK_M)
    num_assignments = num_tokens * top_k
    act = torch.empty(num_assignments, inter, dtype=x.dtype, device=x.device)
    # Assignments to other ranks' experts are never written; they must add nothing to the combine.
    expert_out = torch.zeros(num_assignments, hidden, dtype=x.dtype, device=x.device)
    dot_fp32 = x.dtype == torch.float32 or not x.is_cuda
    has_scale = gate_up_scale is not None
    block_n, block_k = 64, 64
    _gate_up_kernel[(tile_expert.shape[0], triton.cdiv(inter, block_n))](
        x, gate_up_proj.contiguous(), gate_up_scale.float().contiguous() if has_scale else x,
        scores.reshape(-1).contiguous(), sorted_rows, tile_expert, act, hidden, inter, top_k,
        HAS_SCALE=has_scale, DOT_FP32=dot_fp32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    _down_kernel[(tile_expert.shape[0], triton.cdiv(hidden, block_n))](
        act, down_proj.contiguous(), down_scale.float().contiguous() if down_scale is not None else x,
        sorted_rows, tile_expert, expert_out, inter, hidden, HAS_SCALE=down_scale is not None,
        DOT_FP32=dot_fp32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    combine_block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, combine_block))](
        expert_out, out, hidden, TOP_K=top_k, BLOCK=combine_block)
    return out
