"""CUDA graph steps: which steps take a graph, and that padding a batch up to a captured size
changes nothing for the real sequences (checked eagerly on CPU; the capture itself runs in
benchmarks/gpu_check.py and in the CUDA-only test at the end)."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_checkpoints import make_text_checkpoint
from helpers.steps import build_step
from warpspec.workers.compile.cuda_graphs import (
    CudaGraphConfig,
    CudaGraphRunner,
    max_window_blocks,
    pad_step,
    uniform_query_len,
)
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep, StepInput

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("graphs"), interleave_moe_layer_step=1,
                                attention_chunk_size=8)


@pytest.fixture(scope="module")
def mid_block_checkpoint(tmp_path_factory):
    """Chunks of 6 in blocks of 4: every other chunk starts inside a block."""
    return make_text_checkpoint(tmp_path_factory.mktemp("graphs6"), interleave_moe_layer_step=1,
                                attention_chunk_size=6)


def prefill_then(runner: ModelRunner, prompts, tables, new_tokens) -> StepInput:
    """Prefill each prompt, then return the step that runs `new_tokens` more tokens per sequence
    (each chunked group of a hybrid cache on blocks of its own: tests/helpers/steps.py)."""
    runner.execute(build_step(runner, [SequenceStep(p, 0, t, 0) for p, t in zip(prompts, tables, strict=True)]))
    return build_step(runner, [SequenceStep(n, len(p), t, 0) for p, t, n in zip(prompts, tables, new_tokens,
                                                                                  strict=True)])


def test_only_uniform_all_logit_steps_are_graph_shaped():
    decode = StepInput.build([SequenceStep([5], 3, [0], 0), SequenceStep([6], 7, [1, 2], 0)], BLOCK)
    verify = StepInput.build([SequenceStep([5, 6, 7, 8], 3, [0, 1], 0)] * 2, BLOCK)
    mixed = StepInput.build([SequenceStep([5], 3, [0], 0), SequenceStep([6, 7], 0, [1], 0)], BLOCK)
    prefill_tail = StepInput.build([SequenceStep([5, 6], 0, [0], 1)], BLOCK)  # logits for the last token only
    assert uniform_query_len(decode) == 1
    assert uniform_query_len(verify) == 4
    assert uniform_query_len(mixed) is None
    assert uniform_query_len(prefill_tail) is None


def test_graph_config_rejects_empty_sizes():
    with pytest.raises(ValueError, match="batch_sizes must be positive"):
        CudaGraphConfig(batch_sizes=())
    with pytest.raises(ValueError, match="query_lens must be positive"):
        CudaGraphConfig(query_lens=(0,))


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("query_len", [1, 4])
def test_padding_sequences_leave_real_outputs_and_cache_unchanged(mid_block_checkpoint, query_len, hybrid):
    """3 real sequences padded to 8: the real rows' logits equal the unpadded step's, and every KV
    block but the spare one holds the same values afterwards. Hybrid: each chunked group's window
    tables are widened to the graph's width and the padding writes the spare block in every group;
    the sequences sit in their first chunk, past one, and past three, two of them from a chunk start
    inside a block."""
    gen = torch.Generator().manual_seed(query_len)
    prompts = [torch.randint(3, 160, (n,), generator=gen).tolist() for n in (5, 9, 20)]
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    new_tokens = [torch.randint(3, 160, (query_len,), generator=gen).tolist() for _ in prompts]
    cache = CacheConfig(block_size=BLOCK, num_blocks=16, hybrid=hybrid)
    runners = [ModelRunner(mid_block_checkpoint, "float32", cache) for _ in range(2)]
    assert runners[0].kv_layout.is_hybrid == hybrid
    spare = runners[0].num_blocks - 1  # past every group's blocks (tests/helpers/steps.py)
    steps = [prefill_then(r, prompts, tables, new_tokens) for r in runners]
    plain = runners[0].execute(steps[0])
    window_blocks = max_window_blocks(6, query_len, BLOCK, max_blocks=8) if hybrid else None
    padded_step = pad_step(steps[1], batch_size=8, pad_block=spare, max_blocks=8, block_size=BLOCK,
                           window_blocks=window_blocks)
    assert padded_step.num_tokens == 8 * query_len and padded_step.block_tables.shape == (8, 8)
    if hybrid:
        assert padded_step.window_tables.shape == (8, 3, window_blocks)
        assert padded_step.window_starts.tolist()[:3] == [0, 4, 16]  # chunk starts 0, 6 and 18, by block
    for cache in runners[1].kv_caches:
        cache[:, spare] = 7.0  # a sentinel the padding sequences' writes replace
    padded = runners[1].execute(padded_step)
    torch.testing.assert_close(padded.logits[: 3 * query_len], plain.logits, atol=1e-5, rtol=1e-5)
    for cache_plain, cache_padded in zip(runners[0].kv_caches, runners[1].kv_caches, strict=True):
        torch.testing.assert_close(cache_padded[:, :spare], cache_plain[:, :spare], atol=1e-5, rtol=1e-5)
        # The padding wrote its q positions into the spare block, and nowhere else.
        assert (cache_padded[:, spare, :query_len] != 7.0).all() and (cache_padded[:, spare, query_len:] == 7.0).all()


def test_a_graph_holds_the_widest_window_a_step_can_carry():
    """Every context length's window table fits max_window_blocks, and the widest reaches it, for
    chunks that blocks divide and chunks they do not."""
    for chunk, block, query_len in [(8, 4, 1), (8, 4, 4), (6, 4, 4), (12, 16, 4), (48, 16, 1), (48, 16, 4)]:
        widths = []
        for num_cached in range(0, 6 * chunk):
            end = num_cached + query_len
            table = list(range(-(-end // block)))
            step = StepInput.build([SequenceStep([5] * query_len, num_cached, table, 0, window_tables=[table])],
                                   block, chunk_size=chunk)
            widths.append(step.window_tables.shape[2])
        bound = max_window_blocks(chunk, query_len, block, max_blocks=1 << 20)
        assert max(widths) == bound, (chunk, block, query_len)


def test_steps_that_do_not_fit_run_eagerly(checkpoint):
    graphs = CudaGraphRunner.__new__(CudaGraphRunner)  # the size rules only; capturing needs CUDA
    graphs.config, graphs.block_size, graphs.max_blocks = CudaGraphConfig(batch_sizes=(1, 2, 4)), BLOCK, 3
    decode = [SequenceStep([5], 3, [0], 0)]
    assert graphs.graph_batch_size(StepInput.build(decode * 3, BLOCK)) == 4
    assert graphs.graph_batch_size(StepInput.build(decode * 5, BLOCK)) is None  # above the largest size
    assert graphs.graph_batch_size(StepInput.build([SequenceStep([5, 6], 3, [0, 1], 0)], BLOCK)) is None  # q=2
    long = [SequenceStep([5], 13, [0, 1, 2, 3], 0)]  # 14 tokens > 3 blocks of 4
    assert graphs.graph_batch_size(StepInput.build(long, BLOCK)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_graph_replay_matches_eager_on_gpu(mid_block_checkpoint, hybrid):
    """Two decode steps of one graph, the second a replay with longer contexts; when hybrid, the
    longer sequence's chunk starts at 18, inside block 4."""
    cache = CacheConfig(block_size=BLOCK, num_blocks=16, hybrid=hybrid)
    eager = ModelRunner(mid_block_checkpoint, "float32", cache, "cuda")
    graphed = ModelRunner(mid_block_checkpoint, "float32", cache, "cuda", cuda_graphs=CudaGraphConfig(max_model_len=64))
    assert graphed.kv_layout.is_hybrid == hybrid
    prompts, tables = [[5, 6, 7], list(range(3, 21))], [[0, 1], [2, 3, 4, 5, 6, 7]]
    for runner in (eager, graphed):
        runner.execute(build_step(runner, [SequenceStep(p, 0, t, 0) for p, t in zip(prompts, tables, strict=True)]))
    for short, long in ((3, 18), (4, 19)):
        seqs = [SequenceStep([10 + short], short, tables[0], 0), SequenceStep([long], long, tables[1], 0)]
        expected = eager.execute(build_step(eager, seqs)).logits
        got = graphed.execute(build_step(graphed, seqs)).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert graphed.graph_runner.num_replays == 2
