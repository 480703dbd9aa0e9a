"""Every Triton kernel against its torch reference, run on CPU by the Triton interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py before triton is imported).

Tolerances per dtype: float32 outputs agree to 1e-5 (only the summation order differs). bfloat16:
the kernels round where the reference rounds (up to three times on a path), and the interpreter's
float32 -> bfloat16 conversion may land one unit in the last place (up to 2^-7 relative) away from
torch's round-to-nearest at each: 3 ulp relative, plus an absolute floor for values near zero.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from helpers.window_tables import window_of  # noqa: E402
from warpspec.kernels.attention import PagedAttentionMetadata, paged_attention_reference, write_kv_cache  # noqa: E402
from warpspec.kernels.fp8 import quantize_fp8_columns  # noqa: E402
from warpspec.kernels.moe import moe_experts_reference, route_topk_sigmoid_reference  # noqa: E402
from warpspec.kernels.norm import add_rms_norm_reference, rms_norm_reference  # noqa: E402
from warpspec.kernels.rope import rope_qk_norm_reference  # noqa: E402
from warpspec.kernels.triton.attention import paged_attention_triton  # noqa: E402
from warpspec.kernels.triton.moe import (  # noqa: E402
    GemmConfig,
    MoeConfig,
    align_by_expert,
    align_few_by_expert,
    choose_config,
    moe_experts_triton,
    route_topk_sigmoid_triton,
)
from warpspec.kernels.triton.norm import add_rms_norm_triton, rms_norm_triton  # noqa: E402
from warpspec.kernels.triton.rope import rope_qk_norm_triton  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=3 * 2**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 80), (3, 256)])  # 80: a row that is not a power of 2
def test_add_rms_norm(dtype, num_tokens, hidden):
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    normed, new_residual = add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_normed, ref_residual = add_rms_norm_reference(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, ref_normed, **TOLERANCE[dtype])
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_qk_norm(dtype, qk_norm):
    gen = torch.Generator().manual_seed(int(qk_norm))
    num_tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 100  # large positions too
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    eps = 1e-6 if qk_norm else None
    q_out, k_out = rope_qk_norm_triton(q, k, freqs_cis, eps)
    q_ref, k_ref = rope_qk_norm_reference(q, k, freqs_cis, eps)
    torch.testing.assert_close(q_out, q_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOLERANCE[dtype])


def paged_batch(gen, shapes, heads, kv_heads, head_dim, block_size, dtype):
    """Random cache contents for sequences given as (already cached, new this step), scattered over
    shuffled blocks; returns (query, key_cache, value_cache, metadata)."""
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)  # stale data
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    kv_cache = torch.stack([key_cache, value_cache])
    key_cache, value_cache = kv_cache
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for num_cached, q_len in shapes:
        seq_len = num_cached + q_len
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        write_kv_cache(k, v, kv_cache, slots)
        tables.append(table)
    block_tables = torch.zeros(len(shapes), max(map(len, tables)) + 1, dtype=torch.int32)  # a spare column
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table)
    query_lens = torch.tensor([n for _, n in shapes])
    seq_lens = torch.tensor([c + n for c, n in shapes])
    meta = PagedAttentionMetadata(torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]), seq_lens,
                                  block_tables, block_size, int(query_lens.max()), int(seq_lens.max()))
    query = torch.randn(int(query_lens.sum()), heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (5, 1), (8, 2)])  # MHA, Maverick's 5:1 GQA per rank, 4:1
@pytest.mark.parametrize("step", ["decode", "verify", "mixed"])
def test_paged_attention(dtype, chunk_size, heads, kv_heads, step):
    gen = torch.Generator().manual_seed(heads + kv_heads + (chunk_size or 0))
    shapes = {
        # one query each: at a block's first slot, its last slot, mid-block, crossing a chunk edge
        "decode": [(4, 1), (7, 1), (2, 1), (15, 1)],
        # k+1 = 4 queries each: crossing a block edge, a chunk edge, starting at position 0
        "verify": [(2, 4), (6, 4), (0, 4)],
        # a prefill chunk, a decode and a verification in one step
        "mixed": [(0, 19), (9, 1), (13, 4)],
    }[step]
    query, key_cache, value_cache, meta = paged_batch(gen, shapes, heads, kv_heads, 16, 4, dtype)
    scale = 1 / math.sqrt(16)
    out = paged_attention_triton(query, key_cache, value_cache, meta, scale, chunk_size)
    expected = paged_attention_reference(query, key_cache, value_cache, meta, scale, chunk_size)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [2, 3, 9])
@pytest.mark.parametrize("chunk_size", [None, 64])
def test_paged_attention_split_context(num_splits, chunk_size):
    """Flash-decoding: the visible positions split over programs, merged by a second kernel. 9 splits
    leave some programs without a tile (a 0-token chunk start, 4 tiles of 32); chunk 64 makes the
    visible range start mid-context."""
    gen = torch.Generator().manual_seed(num_splits)
    shapes = [(100, 1), (130, 4), (0, 3)]
    query, key_cache, value_cache, meta = paged_batch(gen, shapes, 5, 1, 16, 16, torch.float32)
    out = paged_attention_triton(query, key_cache, value_cache, meta, 0.25, chunk_size, num_splits=num_splits)
    expected = paged_attention_reference(query, key_cache, value_cache, meta, 0.25, chunk_size)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_split_count_fills_the_gpu_only_when_few_programs_exist():
    from warpspec.kernels.triton.attention import choose_num_splits

    assert choose_num_splits(num_tokens=1, num_kv_heads=1, max_seq_len=4096) == 8  # 4096 / 512
    assert choose_num_splits(num_tokens=1, num_kv_heads=1, max_seq_len=100_000) == 16  # the cap
    assert choose_num_splits(num_tokens=8, num_kv_heads=1, max_seq_len=100_000) == 16  # 128 / 8
    assert choose_num_splits(num_tokens=64, num_kv_heads=1, max_seq_len=100_000) == 2
    assert choose_num_splits(num_tokens=256, num_kv_heads=1, max_seq_len=100_000) == 1  # enough programs
    assert choose_num_splits(num_tokens=1, num_kv_heads=1, max_seq_len=300) == 1  # too short to split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_route_topk_sigmoid(dtype, top_k):
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(9, 12, generator=gen).to(dtype)  # 12 experts: not a power of 2
    expert_ids, scores = route_topk_sigmoid_triton(logits, top_k)
    ref_ids, ref_scores = route_topk_sigmoid_reference(logits, top_k)
    assert torch.equal(expert_ids, ref_ids)
    torch.testing.assert_close(scores, ref_scores, **TOLERANCE[dtype])


def test_align_by_expert_pads_each_expert_to_whole_tiles():
    # experts [2, 0, 2, 9(other rank), 0, 0], tiles of 2 rows, 3 local experts:
    # expert 0 -> rows [1, 4 | 5, pad], expert 2 -> rows [0, 2]; 6 // 2 + 3 = 6 tiles.
    sorted_rows, tile_expert = align_by_expert(torch.tensor([2, 0, 2, 9, 0, 0]), num_local=3, block_m=2)
    assert tile_expert.tolist() == [0, 0, 2, -1, -1, -1]
    assert sorted_rows.tolist()[:6] == [1, 4, 5, -1, 0, 2]
    assert (sorted_rows[6:] == -1).all()


@pytest.mark.parametrize("num_rows,num_local,first_expert", [(1, 128, 0), (6, 3, 0), (17, 8, 2), (64, 5, 1)])
def test_align_few_matches_align_by_expert(num_rows, num_local, first_expert):
    """The one-launch alignment for decode's few rows gives the torch version's tiles exactly, with
    rows of other ranks' experts (ids outside [first_expert, first_expert + num_local)) left out."""
    gen = torch.Generator().manual_seed(num_rows)
    expert_ids = torch.randint(0, num_local + 3, (num_rows,), generator=gen)
    want = align_by_expert(expert_ids - first_expert, num_local, block_m=16)
    got = align_few_by_expert(expert_ids, first_expert, num_local, block_m=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def random_experts(gen, num_experts, hidden, inter, dtype, fp8: bool):
    gate_up = torch.randn(num_experts, hidden, 2 * inter, generator=gen) / math.sqrt(hidden)
    down = torch.randn(num_experts, inter, hidden, generator=gen) / math.sqrt(inter)
    if not fp8:
        return gate_up.to(dtype), down.to(dtype), None, None
    # Per-output-channel scales: the largest magnitude in each output column maps to e4m3's 448.
    (gate_up, gate_up_scale), (down, down_scale) = quantize_fp8_columns(gate_up), quantize_fp8_columns(down)
    return gate_up, down, gate_up_scale, down_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens,top_k,first_expert", [(1, 1, 0), (21, 1, 0), (13, 2, 2)])
def test_moe_experts(dtype, fp8, num_tokens, top_k, first_expert):
    """1 token (the small-batch path: one tile busy), 21 tokens (tiles with padding rows), and a rank
    holding experts 2..5 of 8 with top-2 routing (some assignments belong to other ranks)."""
    gen = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    num_experts, num_local, hidden, inter = 8, 4 if first_expert else 8, 96, 80
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    expert_ids, scores = route_topk_sigmoid_reference(torch.randn(num_tokens, num_experts, generator=gen), top_k)
    scores = scores.to(dtype)
    weights = random_experts(gen, num_local, hidden, inter, dtype, fp8)
    out = moe_experts_triton(x, *weights[:2], expert_ids, scores, first_expert, *weights[2:])
    expected = moe_experts_reference(x, *weights[:2], expert_ids, scores, first_expert, *weights[2:])
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tolerance)
    if first_expert:
        is_remote_only = ((expert_ids < first_expert) | (expert_ids >= first_expert + num_local)).all(dim=1)
        assert (out[is_remote_only] == 0).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_experts_on_a_width_slice(fp8):
    """moe_parallel="tensor": a rank holds every expert with a quarter of the intermediate width
    (80 -> 20 columns, not a multiple of the kernel's tiles), quantized per slice. Same routing, same
    contract: the kernel agrees with the reference on the slice, and in full precision the four
    ranks' partials add up to the whole experts' output."""
    from test_moe import width_slice

    gen = torch.Generator().manual_seed(3)
    num_experts, hidden, inter, world_size = 5, 96, 80, 4
    x = torch.randn(13, hidden, generator=gen)
    expert_ids, scores = route_topk_sigmoid_reference(torch.randn(13, num_experts, generator=gen), 2)
    gate_up, down, _, _ = random_experts(gen, num_experts, hidden, inter, torch.float32, fp8=False)
    parts = []
    for rank in range(world_size):
        gate_up_r, down_r = width_slice(gate_up, down, rank, world_size)
        weights = (*quantize_fp8_columns(gate_up_r), *quantize_fp8_columns(down_r)) if fp8 else \
            (gate_up_r, None, down_r, None)
        args = (x, weights[0], weights[2], expert_ids, scores, 0, weights[1], weights[3])
        out = moe_experts_triton(*args)
        torch.testing.assert_close(out, moe_experts_reference(*args), **TOLERANCE[torch.float32])
        parts.append(out)
    if not fp8:
        whole = moe_experts_reference(x, gate_up, down, expert_ids, scores)
        torch.testing.assert_close(sum(parts), whole, **TOLERANCE[torch.float32])


# K cut in 3 pieces: hidden 96 -> [0, 32) [32, 64) [64, 96); inter 80 -> [0, 32) [32, 64) [64, 80).
SPLIT = MoeConfig(GemmConfig(block_n=32, block_k=16, split_k=3), GemmConfig(block_n=32, block_k=16, split_k=3))
UNSPLIT = MoeConfig(GemmConfig(block_n=32, block_k=16), GemmConfig(block_n=32, block_k=16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_experts_split_k_agrees_with_unsplit(dtype, fp8):
    """Pieces of K in programs of their own (5 tokens x top-2 on a rank of experts 2..5: some rows
    are another rank's, and the partials of both GEMMs are reduced by the epilogue and the combine)
    against one program walking all of K, and against the reference."""
    gen = torch.Generator().manual_seed(11)
    hidden, inter = 96, 80
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    expert_ids, scores = route_topk_sigmoid_reference(torch.randn(5, 8, generator=gen), 2)
    weights = random_experts(gen, 4, hidden, inter, dtype, fp8)
    args = (x, *weights[:2], expert_ids, scores.to(dtype), 2, *weights[2:])
    split, unsplit = moe_experts_triton(*args, config=SPLIT), moe_experts_triton(*args, config=UNSPLIT)
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(split, unsplit, **tolerance)
    torch.testing.assert_close(split, moe_experts_reference(*args), **tolerance)
    is_remote_only = ((expert_ids < 2) | (expert_ids >= 6)).all(dim=1)
    assert (split[is_remote_only] == 0).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_split_pieces_sum_the_same_in_one_program(monkeypatch, fp8):
    """Past MAX_SPLIT_ROWS one program walks the pieces itself, in the same order: the same bits as
    a program per piece (in float32, where no rounding would hide a different order)."""
    import warpspec.kernels.triton.moe as moe

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(7, 96, generator=gen)
    expert_ids, scores = route_topk_sigmoid_reference(torch.randn(7, 4, generator=gen), 2)
    weights = random_experts(gen, 4, 96, 80, torch.float32, fp8)
    args = (x, *weights[:2], expert_ids, scores, 0, *weights[2:])
    per_piece = moe_experts_triton(*args, config=SPLIT)
    monkeypatch.setattr(moe, "MAX_SPLIT_ROWS", 0)
    assert torch.equal(moe_experts_triton(*args, config=SPLIT), per_piece)


def test_moe_config_follows_the_weights_only():
    """Maverick's expert at a tensor-parallel rank's width (inter 8192 / 8) and whole: a busy tile
    gets up to 1024 programs, each piece at least 4 steps of K; a tiny expert is not split."""
    rank = choose_config(5120, 1024, torch.float8_e4m3fn)
    # 16 column blocks x 16 pieces of 5 steps; 80 x 4 of 4 steps
    assert (rank.gate_up.split_k, rank.down.split_k) == (16, 4)
    whole = choose_config(5120, 8192, torch.float8_e4m3fn)
    assert (whole.gate_up.split_k, whole.down.split_k) == (8, 8)  # 128 x 8 of 10 steps; 80 x 8 of 16
    assert choose_config(96, 80, torch.bfloat16).gate_up.split_k == 1


def test_forced_dispatch_runs_triton_on_cpu(monkeypatch):
    """WARPSPEC_KERNELS=triton routes the public ops to Triton on CPU tensors (the interpreter), and
    =reference forces the reference; an unknown value is refused with the choices."""
    from warpspec.kernels import dispatch, rms_norm

    x, weight = torch.randn(3, 32), torch.ones(32)
    calls = []
    import warpspec.kernels.triton.norm as triton_norm

    original = triton_norm.rms_norm_triton
    monkeypatch.setattr(triton_norm, "rms_norm_triton", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("WARPSPEC_KERNELS", "triton")
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    assert calls == [1]
    monkeypatch.setenv("WARPSPEC_KERNELS", "reference")
    rms_norm(x, weight, 1e-5)
    assert calls == [1]
    monkeypatch.setenv("WARPSPEC_KERNELS", "fast")
    with pytest.raises(ValueError, match="WARPSPEC_KERNELS='fast' is not one of auto, reference, triton"):
        dispatch.use_triton(x)


@pytest.mark.parametrize("chunk_size", [8, 12])
def test_paged_attention_over_a_window_table(chunk_size):
    """A hybrid KV cache's chunked table, starting at the chunk's first block (12: mid-block), reads
    as the reference over the same window, split or not."""
    gen = torch.Generator().manual_seed(chunk_size)
    query, key_cache, value_cache, meta = paged_batch(gen, [(0, 19), (9, 1), (13, 4), (30, 1)], 5, 1, 16, 4,
                                                      torch.float32)
    window = window_of(meta, chunk_size, scramble=False)
    expected = paged_attention_reference(query, key_cache, value_cache, meta, 0.25, chunk_size)
    for num_splits in (1, 2):
        out = paged_attention_triton(query, key_cache, value_cache, window, 0.25, chunk_size, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
