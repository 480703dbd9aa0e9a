"""Deterministic mode, op by op: a row computed amid other rows (a larger batch, a verification's k+1
positions, a batch padded to a longer context) has the same bits as the row computed alone. The
torch references on CPU, and the Triton kernels under the interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from warpspec.kernels import batch_invariant
from warpspec.kernels.attention import PagedAttentionMetadata, paged_attention_reference, write_kv_cache
from warpspec.kernels.moe import moe_experts_reference, route_topk_sigmoid_reference

LOW_PRECISION = [torch.bfloat16, torch.float16]


def test_the_mode_is_scoped_and_restores_the_previous_setting():
    assert not batch_invariant.is_enabled()
    with batch_invariant.deterministic():
        assert batch_invariant.is_enabled()
        with batch_invariant.deterministic(False):
            assert not batch_invariant.is_enabled()
        assert batch_invariant.is_enabled()
    assert not batch_invariant.is_enabled()


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_linear_rows_match_alone_at_every_batch_size(dtype):
    """The bundled target's down_proj shape, 768 -> 256: without the mode, oneDNN's bf16 GEMM on this
    project's CPUs sums the rows of batches past 32 in another order than a lone row."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 768, generator=gen).to(dtype)
    x = torch.randn(70, 768, generator=gen).to(dtype)
    with batch_invariant.deterministic():
        alone = torch.cat([batch_invariant.linear(x[i : i + 1], weight) for i in range(len(x))])
        for num_rows in range(1, len(x) + 1):
            assert torch.equal(batch_invariant.linear(x[:num_rows], weight), alone[:num_rows]), num_rows
    # And it is the product, rounded once: within half a bf16 ulp of the float64 value.
    exact = x.double() @ weight.double().T
    torch.testing.assert_close(alone.double(), exact, atol=1e-6, rtol=2**-8)


def _paged_sequences(dtype, lengths, gen, block_size=4, kv_heads=2, d=32):
    """A cache holding sequences of the given lengths in shuffled blocks; returns the caches and each
    sequence's block table."""
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, d, dtype=dtype)
    key_cache, value_cache = kv_cache
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // block_size))]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv_cache(torch.randn(n, kv_heads, d, generator=gen).to(dtype),
                       torch.randn(n, kv_heads, d, generator=gen).to(dtype), kv_cache, slots)
        tables.append(table)
    return key_cache, value_cache, tables


def _meta(seq_lens, query_lens, tables, block_size=4) -> PagedAttentionMetadata:
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_lens_t = torch.tensor(query_lens)
    return PagedAttentionMetadata(torch.cat([torch.zeros(1, dtype=torch.long), query_lens_t.cumsum(0)]),
                                  torch.tensor(seq_lens), block_tables, block_size, max(query_lens), max(seq_lens))


def _attention_cases(attention, dtype, length: int, other: int):
    """Sequence 0 (length tokens) seen four ways: each of its last 4 positions decoded alone; the 4 as
    one verification; its last position decoded beside a longer sequence (the batch padded to other
    tokens); and its last 4 positions beside a 13-token prefill. The bundled target's attention
    shape: 8 query heads over 2 KV heads of 32 dims."""
    gen = torch.Generator().manual_seed(1)
    heads, d = 8, 32
    key_cache, value_cache, tables = _paged_sequences(dtype, [length, other, 13], gen)
    q = torch.randn(4, heads, d, generator=gen).to(dtype)  # sequence 0's positions 36..39
    other_q = torch.randn(13, heads, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)

    def run(queries, seq_lens, query_lens, seq_tables):
        return attention(queries, key_cache, value_cache, _meta(seq_lens, query_lens, seq_tables), scale, None)

    with batch_invariant.deterministic():
        alone = torch.cat([run(q[j : j + 1], [length - 3 + j], [1], [tables[0]]) for j in range(4)])
        verify = run(q, [length], [4], [tables[0]])
        beside_long = run(torch.cat([q[3:], other_q[:1]]), [length, other], [1, 1], tables[:2])[:1]
        beside_prefill = run(torch.cat([q, other_q]), [length, 13], [4, 13], [tables[0], tables[2]])[:4]
    return alone, verify, beside_long, beside_prefill


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("length,other", [(40, 200), (300, 1100)])
def test_attention_reference_rows_match_a_lone_decode(dtype, length, other):
    """Without the mode, on this project's CPUs, bf16 SDPA changes the (40, 200) decode beside the
    long sequence and the (300, 1100) verification."""
    alone, verify, beside_long, beside_prefill = _attention_cases(paged_attention_reference, dtype, length, other)
    assert torch.equal(verify, alone)
    assert torch.equal(beside_long, alone[3:])
    assert torch.equal(beside_prefill, alone)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_moe_rows_match_alone(dtype):
    """Top-2 of 4 experts: the tokens an expert receives, and so its GEMM's row count, change with
    the batch."""
    gen = torch.Generator().manual_seed(2)
    hidden, inter, experts = 64, 96, 4
    gate_up = (torch.randn(experts, hidden, 2 * inter, generator=gen) / 8).to(dtype)
    down = (torch.randn(experts, inter, hidden, generator=gen) / 8).to(dtype)
    router = torch.randn(experts, hidden, generator=gen).to(dtype)
    x = torch.randn(40, hidden, generator=gen).to(dtype)

    def moe(rows):
        expert_ids, scores = route_topk_sigmoid_reference(batch_invariant.linear(rows, router), 2)
        return moe_experts_reference(rows, gate_up, down, expert_ids, scores)

    with batch_invariant.deterministic():
        alone = torch.cat([moe(x[i : i + 1]) for i in range(len(x))])
        for num_rows in (2, 7, 40):
            assert torch.equal(moe(x[:num_rows]), alone[:num_rows]), num_rows


triton = pytest.importorskip("triton")


class _RowByRowMatmul:
    """numpy, except that a 2-D matmul computes each row on its own."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, **kwargs):
        if a.ndim != 2:
            return np.matmul(a, b, **kwargs)
        return np.concatenate([np.matmul(a[i : i + 1], b, **kwargs) for i in range(a.shape[0])])


@pytest.fixture
def row_invariant_tile_dot(monkeypatch):
    """The interpreter computes a tile's tl.dot with numpy's matmul. Whether a row's sum depends on
    the row's place in the tile is then up to the host's BLAS kernel: OpenBLAS's Haswell kernel
    (OPENBLAS_CORETYPE=Haswell, set on this project's AMD hosts) sums the rows of a tile's edge
    differently, which a GPU's tile MMA does not. Row by row, the dot is the same wherever a row sits,
    and the tests below check what the kernels decide: which rows share a tile, and the order K is
    walked in."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter, "np", _RowByRowMatmul())


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_triton_linear_rows_match_alone(dtype, row_invariant_tile_dot):
    from warpspec.kernels.triton.matmul import batch_invariant_linear

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(80, 200, generator=gen).to(dtype)  # neither dim a multiple of a tile
    x = torch.randn(37, 200, generator=gen).to(dtype)
    alone = torch.cat([batch_invariant_linear(x[i : i + 1], weight) for i in range(len(x))])
    for num_rows in (2, 33, 37):  # one tile of rows, then two
        assert torch.equal(batch_invariant_linear(x[:num_rows], weight), alone[:num_rows]), num_rows
    torch.testing.assert_close(alone.float(), (x.float() @ weight.float().T), atol=0.05, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_rows_match_a_lone_decode(dtype, row_invariant_tile_dot):
    """With the mode on, the kernel never splits a context: beside a 600-token sequence the lone
    decode would otherwise be split in two (choose_num_splits). In float32 output, where no rounding
    hides it, the split changes the decode's bits."""
    from warpspec.kernels.triton.attention import paged_attention_triton

    alone, verify, beside_long, beside_prefill = _attention_cases(paged_attention_triton, dtype, 40, 600)
    assert torch.equal(verify, alone)
    assert torch.equal(beside_long, alone[3:])
    assert torch.equal(beside_prefill, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_split", [False, True])
def test_triton_moe_rows_match_alone(dtype, is_split, row_invariant_tile_dot):
    """The grouped expert GEMM has fixed tiles of BLOCK_M rows of one expert, and cuts K in pieces
    fixed by the weights' shapes: a token's rows are computed the same in whichever tile, and beside
    whichever tokens, they land. Split: K in 2 pieces for gate_up (hidden 64 -> 32 + 32) and 3 for
    down (inter 96 -> 32 + 32 + 32), each of 2 steps; a token alone and 17 tokens (34 rows) run a
    program per piece, 40 tokens (80 rows, past MAX_SPLIT_ROWS) one program over the pieces."""
    from warpspec.kernels.triton.moe import GemmConfig, MoeConfig, moe_experts_triton, route_topk_sigmoid_triton

    config = MoeConfig(GemmConfig(32, 16, split_k=2), GemmConfig(32, 16, split_k=3)) if is_split else None

    gen = torch.Generator().manual_seed(4)
    hidden, inter, experts = 64, 96, 4
    gate_up = (torch.randn(experts, hidden, 2 * inter, generator=gen) / 8).to(dtype)
    down = (torch.randn(experts, inter, hidden, generator=gen) / 8).to(dtype)
    router_logits = torch.randn(40, experts, generator=gen).to(dtype)
    x = torch.randn(40, hidden, generator=gen).to(dtype)

    def moe(n):
        expert_ids, scores = route_topk_sigmoid_triton(router_logits[:n], 2)
        return moe_experts_triton(x[:n], gate_up, down, expert_ids, scores, config=config)

    alone = torch.cat([moe_experts_triton(x[i : i + 1], gate_up, down, *route_topk_sigmoid_triton(
        router_logits[i : i + 1], 2), config=config) for i in range(len(x))])
    for num_rows in (2, 17, 40):  # within one tile per expert, then across tiles
        assert torch.equal(moe(num_rows), alone[:num_rows]), num_rows
