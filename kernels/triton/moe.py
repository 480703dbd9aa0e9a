"""MoE on the GPU: routing, permutation, grouped expert GEMMs (bf16 or FP8 weights), combine.

The (token, expert) assignments are sorted by expert and each expert's run is padded to a multiple
of BLOCK_M rows, so every BLOCK_M-row tile of the grouped GEMM belongs to one expert and reads only
that expert's weights: with 1 token and top-1 routing one tile is busy and reads one expert. The
number of tiles has a bound that depends only on the shapes (ceil(assignments / BLOCK_M) +
experts), and the busy ones are the first min(tiles, assignments), so nothing here waits on the GPU
and the step can be captured in a CUDA graph.

  expert ids per assignment [2, 0, 2], BLOCK_M 2, 3 local experts
  -> sorted_rows [1, -1 | 0, 2 | -1, -1 | ...]  (expert 0's tile, expert 2's tile, unused tiles)
     tile_expert [0, 2, -1, ...]

At decode one tile is busy, and one program per BLOCK_N columns would leave most of the GPU idle
while each walks all of K. So K is also cut into pieces (GemmConfig.split_k, chosen from the weight
shapes alone): with few rows each piece gets a program and writes float32 partials, and a small
kernel adds them in piece order before the scales, roundings and silu (gate_up) or in the combine
(down). With many rows one program walks the pieces in that same order. No atomics: a row's bits
depend on neither the batch nor the placement (deterministic mode relies on it).
"""

from __future__ import annotations

from dataclasses import dataclass

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
def _align_few_kernel(expert_ids_ptr, sorted_rows_ptr, tile_expert_ptr, num_rows, first_expert, num_local,
                      BLOCK_M: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """align_by_expert's two outputs for one tile, for few rows: each program counts the rows per
    expert again ([rows, experts] compares), which costs less than ~25 torch launches at decode."""
    tile = tl.program_id(0)
    i = tl.arange(0, BLOCK_ROWS)
    ids = tl.load(expert_ids_ptr + i, mask=i < num_rows, other=-1) - first_expert
    is_local = (ids >= 0) & (ids < num_local) & (i < num_rows)
    e = tl.arange(0, BLOCK_E)
    is_expert_of = (ids[:, None] == e[None, :]) & is_local[:, None]  # [rows, experts]
    counts = tl.sum(is_expert_of.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    # The tile's expert is the number of experts whose tiles end at or before it (searchsorted, right).
    tile_start = tile * BLOCK_M
    expert = tl.sum(((padded_end <= tile_start) & (e < num_local)).to(tl.int32), axis=0)
    tl.store(tile_expert_ptr + tile, tl.where(expert < num_local, expert, -1).to(tl.int64))
    # A row's slot: its expert's first slot + the earlier rows of that expert (a stable sort).
    is_earlier = (ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None]) & is_local[None, :]  # [row, other]
    start = tl.sum(tl.where(is_expert_of, (padded_end - padded)[None, :], 0), axis=1)
    dest = tl.where(is_local, start + tl.sum(is_earlier.to(tl.int32), axis=1), -1)
    slots = tile_start + tl.arange(0, BLOCK_M)
    rows = tl.max(tl.where(dest[None, :] == slots[:, None], i[None, :], -1), axis=1)
    tl.store(sorted_rows_ptr + slots, rows.to(tl.int64))


def align_few_by_expert(expert_ids: torch.Tensor, first_expert: int, num_local: int,
                        block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert(expert_ids - first_expert, ...) in one launch, for up to MAX_SPLIT_ROWS rows."""
    num_rows = expert_ids.shape[0]
    num_tiles = triton.cdiv(num_rows, block_m) + num_local
    sorted_rows = torch.empty(num_tiles * block_m, dtype=torch.int64, device=expert_ids.device)
    tile_expert = torch.empty(num_tiles, dtype=torch.int64, device=expert_ids.device)
    _align_few_kernel[(num_tiles,)](expert_ids, sorted_rows, tile_expert, num_rows, first_expert, num_local,
                                    BLOCK_M=block_m, BLOCK_ROWS=max(16, triton.next_power_of_2(num_rows)),
                                    BLOCK_E=max(16, triton.next_power_of_2(num_local)))
    return sorted_rows, tile_expert


@dataclass(frozen=True)
class GemmConfig:
    """Tiling of one grouped GEMM. K is cut into split_k pieces of whole BLOCK_K steps; each piece
    is summed from zero on its own and the pieces are added in order 0, 1, ..., split_k - 1, whether
    one program walks them all or each gets a program of its own (see moe_experts_triton): a row's
    sums are the same either way, so the placement may follow the batch while the bits do not."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def piece(self, k: int) -> int:
        """Width of one piece of K: k 5120, split_k 16, block_k 64 -> 320 (5 steps)."""
        return triton.cdiv(triton.cdiv(k, self.split_k), self.block_k) * self.block_k


@dataclass(frozen=True)
class MoeConfig:
    gate_up: GemmConfig  # K = hidden, N = inter (gate and up columns in the same program)
    down: GemmConfig  # K = inter, N = hidden


# Assignments (tokens x top_k) up to which the pieces of K run in programs of their own: with so few
# rows only one or a few tiles are busy, and inter / block_n programs per tile would leave most SMs
# idle. Past it the busy tiles fill the GPU by themselves, and per-piece float32 partials
# [split_k, rows, width] would cost memory that prefill cannot spare.
MAX_SPLIT_ROWS = 64
# Programs one busy tile may get, and the fewest BLOCK_K steps a piece keeps so that its loads still
# pipeline. At one token a program's time is a chain of dependent K steps, not bandwidth. H200,
# 2026-12-04, one token in a CUDA graph: a 1/8-width expert (inter 1024) 140 -> 20 us per call with
# gate_up in 16 pieces and down in 4 (8 or 32 pieces, or down in 2 or 8: within 2 us); a whole one
# (inter 8192) 284 -> 63 us with 8 and 8 (4 or 16 pieces: within 4 us).
TARGET_PROGRAMS = 1024
MIN_PIECE_STEPS = 4
# Columns per program of the two small kernels that add pieces up (and of the combine): a decode row
# of inter 1024 -> 4 programs, of hidden 5120 -> 20.
REDUCE_BLOCK = 256


def _gemm_config(k: int, n: int, block_n: int, block_k: int) -> GemmConfig:
    """Double split_k while a busy tile has at most TARGET_PROGRAMS programs and each piece keeps
    MIN_PIECE_STEPS steps: k 5120, n 1024, block_n 64, block_k 64 -> 16 column blocks x 16 pieces
    of 5 steps."""
    num_blocks, num_steps, split_k = triton.cdiv(n, block_n), triton.cdiv(k, block_k), 1
    while num_blocks * split_k * 2 <= TARGET_PROGRAMS and num_steps >= split_k * 2 * MIN_PIECE_STEPS:
        split_k *= 2
    return GemmConfig(block_n, block_k, split_k, num_warps=4, num_stages=4)


def choose_config(hidden: int, inter: int, weight_dtype: torch.dtype) -> MoeConfig:
    """From the weights' shapes and dtype alone, never the token count, so that a row's reduction
    order does not depend on the rows beside it. The dtype is not used yet: only FP8 tilings were
    measured, and bf16 weights take the same."""
    block_n, block_k = 64, 64
    return MoeConfig(_gemm_config(hidden, inter, block_n, block_k), _gemm_config(inter, hidden, block_n, block_k))


@triton.jit
def _swiglu(acc_gate, acc_up, out_ptr):
    """silu(gate) * up from the float32 sums (scales applied), rounded to out's dtype where the
    reference rounds: the GEMM's output, silu's, and the product."""
    out_ty = out_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    return ((gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * up).to(out_ty)


@triton.jit
def _gate_up_sum(x_ptr, w_expert, tokens, is_row, row_scores, cols, is_col, k_start, k_end, k_piece, hidden, inter,
                 DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(a @ W_gate, a @ W_up) [BLOCK_M, BLOCK_N] over K in [k_start, k_end): each piece of k_piece
    summed from zero, then added to the total in order. One loop over all the steps rather than one
    per piece, so that the loads stay pipelined across the pieces' ends."""
    total_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    total_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
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
        is_piece_end = ((k0 + BLOCK_K) % k_piece == 0) | (k0 + BLOCK_K >= k_end)
        total_gate = tl.where(is_piece_end, total_gate + acc_gate, total_gate)
        total_up = tl.where(is_piece_end, total_up + acc_up, total_up)
        acc_gate = tl.where(is_piece_end, 0.0, acc_gate)
        acc_up = tl.where(is_piece_end, 0.0, acc_up)
    return total_gate, total_up


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, w_scale_ptr, scores_ptr, sorted_rows_ptr, tile_expert_ptr, out_ptr, partial_ptr,
                    hidden, inter, top_k, num_rows, k_piece, HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
                    IS_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[row] = silu(a @ W_gate) * (a @ W_up), a = x[token of row] * score[row], for one tile of
    BLOCK_M rows of one expert and BLOCK_N columns of the intermediate width. IS_SPLIT: this program
    sums piece program_id(2) of K only and writes it to partial [SPLIT_K, num_rows, 2 * inter] for
    _gate_up_reduce_kernel."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= 0:
        rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        is_row = rows >= 0
        tokens = tl.where(is_row, rows // top_k, 0)
        row_scores = tl.load(scores_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        is_col = cols < inter
        is_out = is_row[:, None] & is_col[None, :]
        w_expert = w_ptr + expert * hidden * 2 * inter
        # One piece of K (IS_SPLIT), or all of it.
        k_start = tl.program_id(2) * k_piece if IS_SPLIT else 0
        k_end = tl.minimum(k_start + k_piece, hidden) if IS_SPLIT else hidden
        acc_gate, acc_up = _gate_up_sum(x_ptr, w_expert, tokens, is_row, row_scores, cols, is_col, k_start, k_end,
                                        k_piece, hidden, inter, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
        if IS_SPLIT:
            partial = partial_ptr + (tl.program_id(2) * num_rows + rows[:, None]) * 2 * inter + cols[None, :]
            tl.store(partial, acc_gate, mask=is_out)
            tl.store(partial + inter, acc_up, mask=is_out)
        else:
            if HAS_SCALE:
                scale_expert = w_scale_ptr + expert * 2 * inter
                acc_gate *= tl.load(scale_expert + cols, mask=is_col, other=0.0)[None, :]
                acc_up *= tl.load(scale_expert + inter + cols, mask=is_col, other=0.0)[None, :]
            tl.store(out_ptr + rows[:, None] * inter + cols[None, :], _swiglu(acc_gate, acc_up, out_ptr), mask=is_out)


@triton.jit
def _gate_up_reduce_kernel(partial_ptr, w_scale_ptr, expert_ids_ptr, out_ptr, num_rows, inter, first_expert,
                           num_local, HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = silu(gate) * up for one assignment row and BLOCK columns, gate and up the sums of
    the SPLIT_K pieces in partial [SPLIT_K, num_rows, 2 * inter], added in the order the unsplit
    kernel adds them."""
    row = tl.program_id(0).to(tl.int64)
    expert = tl.load(expert_ids_ptr + row) - first_expert
    if (expert >= 0) & (expert < num_local):  # another rank's expert: the row was never computed
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        is_col = cols < inter
        acc_gate = tl.zeros((BLOCK,), tl.float32)
        acc_up = tl.zeros((BLOCK,), tl.float32)
        for piece in tl.static_range(SPLIT_K):  # unrolled: the loads go out together, the adds stay in order
            partial = partial_ptr + (piece * num_rows + row) * 2 * inter + cols
            acc_gate += tl.load(partial, mask=is_col, other=0.0)
            acc_up += tl.load(partial + inter, mask=is_col, other=0.0)
        if HAS_SCALE:
            scale_expert = w_scale_ptr + expert * 2 * inter
            acc_gate *= tl.load(scale_expert + cols, mask=is_col, other=0.0)
            acc_up *= tl.load(scale_expert + inter + cols, mask=is_col, other=0.0)
        tl.store(out_ptr + row * inter + cols, _swiglu(acc_gate, acc_up, out_ptr), mask=is_col)


@triton.jit
def _down_sum(act_ptr, w_expert, safe_rows, is_row, cols, is_col, k_start, k_end, k_piece, inter, hidden,
              DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act @ W_down [BLOCK_M, BLOCK_N] over K in [k_start, k_end), piece by piece as _gate_up_sum."""
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + safe_rows[:, None] * inter + ks[None, :],
                    mask=is_row[:, None] & (ks < inter)[None, :], other=0.0)
        w = tl.load(w_expert + ks[:, None] * hidden + cols[None, :],
                    mask=(ks < inter)[:, None] & is_col[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
        is_piece_end = ((k0 + BLOCK_K) % k_piece == 0) | (k0 + BLOCK_K >= k_end)
        total = tl.where(is_piece_end, total + acc, total)
        acc = tl.where(is_piece_end, 0.0, acc)
    return total


@triton.jit
def _down_kernel(act_ptr, w_ptr, w_scale_ptr, sorted_rows_ptr, tile_expert_ptr, out_ptr, partial_ptr, inter, hidden,
                 num_rows, k_piece, HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr, IS_SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[row] = act[row] @ W_down for one tile of one expert's rows and BLOCK_N hidden columns.
    IS_SPLIT: piece program_id(2) of K only, into partial [SPLIT_K, num_rows, hidden] for the combine."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= 0:
        rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        is_row = rows >= 0
        safe_rows = tl.where(is_row, rows, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        is_col = cols < hidden
        is_out = is_row[:, None] & is_col[None, :]
        w_expert = w_ptr + expert * inter * hidden
        k_start = tl.program_id(2) * k_piece if IS_SPLIT else 0
        k_end = tl.minimum(k_start + k_piece, inter) if IS_SPLIT else inter
        acc = _down_sum(act_ptr, w_expert, safe_rows, is_row, cols, is_col, k_start, k_end, k_piece, inter, hidden,
                        DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
        if IS_SPLIT:
            tl.store(partial_ptr + (tl.program_id(2) * num_rows + safe_rows[:, None]) * hidden + cols[None, :], acc,
                     mask=is_out)
        else:
            if HAS_SCALE:
                acc *= tl.load(w_scale_ptr + expert * hidden + cols, mask=is_col, other=0.0)[None, :]
            tl.store(out_ptr + safe_rows[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=is_out)


@triton.jit
def _combine_kernel(expert_out_ptr, partial_ptr, w_scale_ptr, expert_ids_ptr, out_ptr, num_rows, hidden,
                    first_expert, num_local, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr,
                    IS_SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[token] = sum over its k assignments (rows token*k .. token*k+k-1) of the expert outputs;
    the scores were applied to the expert inputs already, as Llama 4 does. Rows of another rank's
    experts were never written and add nothing. IS_SPLIT: a row's output is first the sum of its
    pieces in partial [SPLIT_K, num_rows, hidden], scaled and rounded as _down_kernel does."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        row = token * TOP_K + j
        expert = tl.load(expert_ids_ptr + row) - first_expert
        # where, not &: the interpreter refuses a mask made of a block & a scalar.
        is_used = tl.where((expert >= 0) & (expert < num_local), mask, False)
        if IS_SPLIT:
            y = tl.zeros((BLOCK,), tl.float32)
            for piece in tl.static_range(SPLIT_K):
                y += tl.load(partial_ptr + (piece * num_rows + row) * hidden + cols, mask=is_used, other=0.0)
            if HAS_SCALE:
                y *= tl.load(w_scale_ptr + expert * hidden + cols, mask=is_used, other=0.0)
            acc += y.to(out_ptr.dtype.element_ty).to(tl.float32)
        else:
            acc += tl.load(expert_out_ptr + row * hidden + cols, mask=is_used, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_experts_triton(x, gate_up_proj, down_proj, expert_ids, scores, first_expert=0, gate_up_scale=None,
                       down_scale=None, config: MoeConfig | None = None) -> torch.Tensor:
    """Same contract as kernels.moe.moe_experts. config: the tiling, choose_config's by default.

    At most MAX_SPLIT_ROWS rows (tokens x top_k), decode's case: one launch aligns the rows, the
    pieces of K run in programs of their own, _gate_up_reduce_kernel and the combine add them up;
    5 launches in all. Past it, align_by_expert's torch ops and one program per (tile, columns)."""
    num_tokens, hidden = x.shape
    num_local, _, two_inter = gate_up_proj.shape
    inter, top_k = two_inter // 2, expert_ids.shape[1]
    num_rows = num_tokens * top_k
    config = config or choose_config(hidden, inter, gate_up_proj.dtype)
    gu, dn = config.gate_up, config.down
    # Each of these returns its input where it is already so (the model's parameters, float32 scales,
    # the router's outputs): no copy, no launch.
    x, gate_up_proj, down_proj = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    flat_ids, flat_scores = expert_ids.reshape(-1).contiguous(), scores.reshape(-1).contiguous()  # [num_rows]
    gate_up_scale = gate_up_scale.float().contiguous() if gate_up_scale is not None else None
    down_scale = down_scale.float().contiguous() if down_scale is not None else None
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    # The placement of the pieces follows the row count; the order they are added in does not.
    is_few = num_rows <= MAX_SPLIT_ROWS
    if is_few:
        sorted_rows, tile_expert = align_few_by_expert(flat_ids, first_expert, num_local, BLOCK_M)
    else:
        sorted_rows, tile_expert = align_by_expert(flat_ids - first_expert, num_local, BLOCK_M)
    # Only the first tiles can be busy (the experts' runs are laid out from tile 0 on), and at most one
    # per row: at decode 1 of 129 tiles (128 local experts). Launching programs for the other 128 cost
    # more than the work (H200: ~30 us a GEMM at 1 token, 40 000 programs that exit at once).
    num_busy_tiles = min(tile_expert.shape[0], num_rows)
    dot_fp32 = x.dtype == torch.float32 or not x.is_cuda
    gu_split, dn_split = is_few and gu.split_k > 1, is_few and dn.split_k > 1
    f32 = dict(dtype=torch.float32, device=x.device)
    # An absent tensor argument is passed as x: the kernels never read it (HAS_SCALE, IS_SPLIT off).
    gu_scale_arg = gate_up_scale if gate_up_scale is not None else x
    dn_scale_arg = down_scale if down_scale is not None else x
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    gu_partial = torch.empty(gu.split_k, num_rows, two_inter, **f32) if gu_split else x
    _gate_up_kernel[(num_busy_tiles, triton.cdiv(inter, gu.block_n), gu.split_k if gu_split else 1)](
        x, gate_up_proj, gu_scale_arg, flat_scores, sorted_rows, tile_expert, act, gu_partial, hidden, inter, top_k,
        num_rows, gu.piece(hidden), HAS_SCALE=gate_up_scale is not None, DOT_FP32=dot_fp32,
        IS_SPLIT=gu_split, BLOCK_M=BLOCK_M, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, num_warps=gu.num_warps,
        num_stages=gu.num_stages)
    if gu_split:
        _gate_up_reduce_kernel[(num_rows, triton.cdiv(inter, REDUCE_BLOCK))](
            gu_partial, gu_scale_arg, flat_ids, act, num_rows, inter, first_expert, num_local,
            HAS_SCALE=gate_up_scale is not None, SPLIT_K=gu.split_k, BLOCK=REDUCE_BLOCK)
    # Rows of other ranks' experts stay unwritten (no zero fill): the combine skips them.
    expert_out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device) if not dn_split else x
    dn_partial = torch.empty(dn.split_k, num_rows, hidden, **f32) if dn_split else x
    _down_kernel[(num_busy_tiles, triton.cdiv(hidden, dn.block_n), dn.split_k if dn_split else 1)](
        act, down_proj, dn_scale_arg, sorted_rows, tile_expert, expert_out, dn_partial, inter, hidden, num_rows,
        dn.piece(inter), HAS_SCALE=down_scale is not None, DOT_FP32=dot_fp32, IS_SPLIT=dn_split,
        BLOCK_M=BLOCK_M, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps, num_stages=dn.num_stages)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, REDUCE_BLOCK))](
        expert_out, dn_partial, dn_scale_arg, flat_ids, out, num_rows, hidden, first_expert, num_local, TOP_K=top_k,
        HAS_SCALE=down_scale is not None, SPLIT_K=dn.split_k, IS_SPLIT=dn_split, BLOCK=REDUCE_BLOCK)
    return out
