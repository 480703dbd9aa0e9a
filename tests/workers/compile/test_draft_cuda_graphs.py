"""CUDA graphs of the EAGLE-3 draft's greedy proposal: which captured size a proposal runs at, how it
is padded, and that padding leaves every real request's drafts, and every block but the pad block,
as they were (on the CPU, with the eager proposal the graph captures). On a CUDA device, the replayed
drafts against the proposal run without graphs."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers.eagle3_checkpoints import make_speculation_draft, make_speculation_target
from warpspec.sample.keyed_random import KeyedRandom
from warpspec.spec_decode.eagle3 import Eagle3Proposer
from warpspec.spec_decode.proposer import DraftRequest
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.compile.draft_cuda_graphs import DraftGraphRunner, pad_greedy_proposal
from warpspec.workers.loader import read_checkpoint_tensor
from warpspec.workers.models.eagle3_draft import load_eagle3
from warpspec.workers.models.registry import load_model_config

BLOCK = 4
K = 3
PAD_BLOCK = 40  # no request's table reaches it


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_speculation_target(tmp_path_factory.mktemp("target"))
    draft = make_speculation_draft(tmp_path_factory.mktemp("draft"))
    config = load_model_config(target)
    return draft, config, read_checkpoint_tensor(target, "model.embed_tokens.weight", config).float()


def _proposer(pair, device: str = "cpu", cuda_graphs: CudaGraphConfig | None = None) -> Eagle3Proposer:
    draft, config, embed = pair
    return Eagle3Proposer(load_eagle3(draft, config, embed, torch.float32), num_blocks=48, block_size=BLOCK,
                          device=device, compile=cuda_graphs is not None, num_speculative_tokens=K,
                          cuda_graphs=cuda_graphs)


def _greedy_requests(first_positions: list[int], num_positions: list[int]) -> list[DraftRequest]:
    """Requests that each verified k + 1 rows and want k greedy drafts; table i holds blocks 6i..6i+5."""
    tokens = torch.Generator().manual_seed(sum(first_positions))
    return [DraftRequest(f"r{i}", torch.randint(3, 160, (n,), generator=tokens).tolist(), first, i * (K + 1), K,
                         list(range(6 * i, 6 * i + 6)), 0.0, KeyedRandom(i))
            for i, (first, n) in enumerate(zip(first_positions, num_positions, strict=True))]


def _aux(num_requests: int, hidden: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(num_requests)
    return [torch.randn(num_requests * (K + 1), hidden, generator=gen) for _ in range(3)]


def test_a_proposal_runs_at_the_smallest_captured_size_that_holds_it():
    runner = DraftGraphRunner(None, (8, 1, 2, 4), max_blocks=16, block_size=BLOCK)
    assert runner.graph_batch_size(1, 3) == 1
    assert runner.graph_batch_size(3, 16) == 4
    assert runner.graph_batch_size(8, 5) == 8
    assert runner.graph_batch_size(9, 5) is None  # more requests than the largest graph
    assert runner.graph_batch_size(2, 17) is None  # a table longer than a captured step allows


def test_padding_adds_requests_of_the_pad_block_only():
    catch_up = K + 1
    inputs = (torch.arange(8), torch.ones(8, 6), torch.arange(8) + 10, torch.tensor([0, 4, 8]), torch.tensor([14, 18]),
              torch.tensor([[5, 6], [9, 0]], dtype=torch.int32), torch.arange(8) + 100, torch.tensor([3, 7]))
    padded = pad_greedy_proposal(inputs, 3, PAD_BLOCK, 5, BLOCK)
    ids, features, positions, starts, seq_lens, tables, slots, last = padded
    assert ids.tolist() == list(range(8)) + [0] * catch_up
    assert features.shape == (12, 6) and features[8:].abs().sum() == 0
    assert positions.tolist() == [*range(10, 18), 0, 1, 2, 3]
    assert starts.tolist() == [0, 4, 8, 12] and seq_lens.tolist() == [14, 18, catch_up]
    assert tables.tolist() == [[5, 6, 0, 0, 0], [9, 0, 0, 0, 0], [PAD_BLOCK] * 5]
    assert slots.tolist() == [*range(100, 108), *(PAD_BLOCK * BLOCK + p for p in range(catch_up))]
    assert last.tolist() == [3, 7, 11]
    with pytest.raises(ValueError, match="does not fit a graph of 1 requests"):
        pad_greedy_proposal(inputs, 1, PAD_BLOCK, 5, BLOCK)
    with pytest.raises(ValueError, match="over 1"):
        pad_greedy_proposal(inputs, 2, PAD_BLOCK, 1, BLOCK)


@pytest.mark.parametrize("num_requests", [1, 3])
def test_padding_leaves_every_real_requests_drafts_and_kv_as_they_were(pair, num_requests):
    proposer = _proposer(pair)
    requests = _greedy_requests([9, 6, 11][:num_requests], [4, 1, 2][:num_requests])
    features = torch.cat(_aux(num_requests, proposer.draft.config.target_hidden_size), dim=-1)
    tables, _ = proposer._with_scratch(requests, padded=True)
    inputs = proposer._greedy_proposal_args(requests, features, tables)
    before = proposer.draft.kv_cache.clone()
    want = proposer._greedy_proposal_forward(*inputs)
    kv_unpadded = proposer.draft.kv_cache.clone()
    proposer.draft.kv_cache.copy_(before)
    got = proposer._greedy_proposal_forward(*pad_greedy_proposal(inputs, 4, PAD_BLOCK, 12, BLOCK))
    assert want.shape == (num_requests, K)
    assert got.shape == (4, K) and torch.equal(got[:num_requests], want)
    # Outside the pad block the same slots were written, with the same values up to the order a GEMM of
    # more rows sums in.
    others = [b for b in range(proposer.draft.kv_cache.shape[1]) if b != PAD_BLOCK]
    written = (kv_unpadded != before)[:, others]
    assert written.any() and torch.equal((proposer.draft.kv_cache != before)[:, others], written)
    torch.testing.assert_close(proposer.draft.kv_cache[:, others], kv_unpadded[:, others], rtol=1e-4, atol=1e-5)
    assert not torch.equal(proposer.draft.kv_cache[:, PAD_BLOCK], before[:, PAD_BLOCK])  # the padding wrote there


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_replayed_drafts_equal_the_proposal_without_graphs(pair):
    shapes = CudaGraphConfig(batch_sizes=(1, 2, 4), query_lens=(1, K + 1), max_model_len=64)
    graphed, plain = _proposer(pair, "cuda", shapes), _proposer(pair, "cuda")
    assert graphed.draft_graphs is not None and plain.draft_graphs is None
    hidden = graphed.draft.config.target_hidden_size
    for positions, lengths in (([9], [4]), ([9, 6, 11], [4, 1, 2]), ([12, 8], [2, 3])):
        requests = _greedy_requests(positions, lengths)
        aux = [a.cuda() for a in _aux(len(requests), hidden)]
        want = [d.token_ids for d in plain.propose(requests, aux)]
        assert [d.token_ids for d in graphed.propose(requests, aux)] == want
    assert graphed.draft_graphs.num_replays == 3 and set(graphed.draft_graphs.graphs) <= {1, 2, 4}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphs_are_captured_anew_in_a_new_pool_when_the_drafts_kv_cache_grows(pair):
    """Scratch blocks grow the draft's KV cache, and every graph holds the old cache: they are captured
    again. Captured into the pool the dropped graphs released, the first one failed an allocator
    assert on an H200 and the draft ran without graphs from then on, with a warning."""
    shapes = CudaGraphConfig(batch_sizes=(1, 2, 4), query_lens=(1, K + 1), max_model_len=64)
    graphed, plain = _proposer(pair, "cuda", shapes), _proposer(pair, "cuda")
    hidden = graphed.draft.config.target_hidden_size
    aux = [a.cuda() for a in _aux(1, hidden)]
    requests = _greedy_requests([9], [4])
    assert [d.token_ids for d in graphed.propose(requests, aux)] == [d.token_ids for d in plain.propose(requests, aux)]
    size = graphed.draft.kv_cache.shape[1]
    # Blocks for positions 0 .. 11 (the catch-up runs 8 .. 11): the drafts run past them, into a
    # scratch block beyond the cache.
    short = [DraftRequest("s0", [5, 6, 7, 8], 8, 0, K, [7, 8, 9], 0.0, KeyedRandom(0))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [d.token_ids for d in graphed.propose(short, aux)]
    assert not [w for w in caught if "CUDA graphs of the EAGLE-3 draft failed" in str(w.message)]
    # A failed capture would have dropped the graph runner and proposed without it.
    assert graphed.draft.kv_cache.shape[1] > size and graphed.draft_graphs is not None
    assert got == [d.token_ids for d in plain.propose(short, aux)]
    assert graphed.draft_graphs.num_replays == 2
