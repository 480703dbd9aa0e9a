"""Paged attention against a plain per-sequence softmax(QK^T)V over contiguous keys/values."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.window_tables import window_of
from warpspec.kernels.attention import PagedAttentionMetadata, paged_attention, write_kv_cache


def dense_reference(q, k, v, num_cached: int, chunk_size: int | None) -> torch.Tensor:
    """q [q_len, heads, d] at positions num_cached.., k/v [seq_len, kv_heads, d] at 0.."""
    q_len, heads, d = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.empty_like(q)
    for i in range(q_len):
        pos = num_cached + i
        visible = [j for j in range(pos + 1) if chunk_size is None or j // chunk_size == pos // chunk_size]
        scores = torch.einsum("hd,jhd->hj", q[i], k[visible]) / math.sqrt(d)
        out[i] = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[visible])
    return out


@pytest.mark.parametrize("chunk_size", [None, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_ragged_batch_matches_dense(chunk_size, heads, kv_heads):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    block_size, num_blocks, d = 4, 64, 8
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, d)
    key_cache, value_cache = kv_cache
    # (already cached, new this step): a fresh prefill, a decode exactly at a block boundary,
    # a 4-token verification crossing a boundary, a one-token prompt.
    shapes = [(0, 11), (8, 1), (6, 4), (0, 1)]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, queries = [], []
    for num_cached, q_len in shapes:
        seq_len = num_cached + q_len
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        k = torch.randn(seq_len, kv_heads, d, generator=gen)
        v = torch.randn(seq_len, kv_heads, d, generator=gen)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        write_kv_cache(k, v, kv_cache, slots)
        q = torch.randn(q_len, heads, d, generator=gen)
        seqs.append((num_cached, table, k, v, q))
        queries.append(q)
    max_blocks = max(len(s[1]) for s in seqs)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for row, (_, table, _, _, _) in enumerate(seqs):
        block_tables[row, : len(table)] = torch.tensor(table)
    query_lens = torch.tensor([q_len for _, q_len in shapes])
    seq_lens = torch.tensor([c + n for c, n in shapes])
    meta = PagedAttentionMetadata(torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]), seq_lens,
                                  block_tables, block_size, int(query_lens.max()), int(seq_lens.max()))
    out = paged_attention(torch.cat(queries), key_cache, value_cache, meta, 1 / math.sqrt(d), chunk_size)
    expected = torch.cat([dense_reference(q, k, v, c, chunk_size) for c, _, k, v, q in seqs])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_batch_matches_dense():
    """One query per sequence takes the uniform path (no query padding)."""
    gen = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads, d = 4, 4, 2, 8
    key_cache = torch.randn(16, block_size, kv_heads, d, generator=gen)
    value_cache = torch.randn(16, block_size, kv_heads, d, generator=gen)
    seq_lens, tables = [5, 9, 1], [[3, 7], [0, 1, 2], [9]]
    block_tables = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(3, heads, d, generator=gen)
    meta = PagedAttentionMetadata(torch.arange(4), torch.tensor(seq_lens), block_tables, block_size, 1, 9)
    assert meta.is_uniform
    out = paged_attention(q, key_cache, value_cache, meta, 1 / math.sqrt(d), chunk_size=4)
    for i, (n, table) in enumerate(zip(seq_lens, tables, strict=True)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k = key_cache.view(-1, kv_heads, d)[slots]
        v = value_cache.view(-1, kv_heads, d)[slots]
        torch.testing.assert_close(out[i : i + 1], dense_reference(q[i : i + 1], k, v, n - 1, 4), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 6, 16])
def test_a_chunked_layer_reads_only_its_window(chunk_size):
    """A hybrid KV cache's chunked table starts at the block of the chunk start (mid-block when the
    block size does not divide the chunk, 6 against 4) and gives what the whole table gives; the
    blocks before it are zeroed in the cache, so a read of them would change the output."""
    gen = torch.Generator().manual_seed(chunk_size)
    block_size, num_blocks, heads, kv_heads, d = 4, 64, 4, 2, 8
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, d)
    # (cached, new): a prefill over several chunks, decodes past a chunk edge and mid-chunk, and a
    # 4-token verification crossing a chunk edge.
    shapes = [(0, 21), (17, 1), (26, 1), (10, 4)]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, queries = [], []
    for num_cached, q_len in shapes:
        seq_len = num_cached + q_len
        tables.append([free.pop() for _ in range(-(-seq_len // block_size))])
        slots = torch.tensor([tables[-1][p // block_size] * block_size + p % block_size for p in range(seq_len)])
        k, v = torch.randn(2, seq_len, kv_heads, d, generator=gen)
        write_kv_cache(k, v, kv_cache, slots)
        queries.append(torch.randn(q_len, heads, d, generator=gen))
    block_tables = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    query_lens = torch.tensor([n for _, n in shapes])
    seq_lens = torch.tensor([c + n for c, n in shapes])
    meta = PagedAttentionMetadata(torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]), seq_lens,
                                  block_tables, block_size, int(query_lens.max()), int(seq_lens.max()))
    q = torch.cat(queries)
    expected = paged_attention(q, kv_cache[0], kv_cache[1], meta, 1 / math.sqrt(d), chunk_size)
    window = window_of(meta, chunk_size)
    for row, table in enumerate(tables):  # blocks wholly before each window hold garbage now
        for block in table[: int(window.kv_starts[row]) // block_size]:
            kv_cache[:, block] = 1e4
    out = paged_attention(q, kv_cache[0], kv_cache[1], window, 1 / math.sqrt(d), chunk_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert window.max_seq_len < meta.max_seq_len
