"""The EAGLE-3 proposer's compiled CPU steps propose what its eager steps propose: the catch-up,
padded to k + 1 positions whatever each request accepted, and the single-token steps after it, for
one request and for several, greedy and sampled; and, when every request drafts greedily, the one
graph that runs them all. Built at warm-up, they compile nothing after."""

from __future__ import annotations

import pytest
import torch

from helpers.eagle3_checkpoints import make_speculation_draft, make_speculation_target
from warpspec.sample.keyed_random import KeyedRandom
from warpspec.spec_decode.draft_runner import CompiledWithFallback, DraftGraphs
from warpspec.spec_decode.eagle3 import GREEDY_PROPOSAL, Eagle3Proposer
from warpspec.spec_decode.proposer import DraftRequest
from warpspec.workers.compile.compiled_step import CountingCompiler
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.compile.torch_internals import fx_graph_cache_counts
from warpspec.workers.loader import read_checkpoint_tensor
from warpspec.workers.models.eagle3_draft import Eagle3Draft, load_eagle3
from warpspec.workers.models.registry import load_model_config

BLOCK = 4
K = 3


@pytest.fixture(scope="module")
def proposers(tmp_path_factory):
    """(eager, compiled) proposers over the same draft weights, each with its own KV cache. The
    embedding is a parameter, as the target's own is in an engine: the draft's saved graphs are then
    named as those of tests/spec_decode/test_speculative.py's engines, which load them."""
    target = make_speculation_target(tmp_path_factory.mktemp("target"))
    draft_path = make_speculation_draft(tmp_path_factory.mktemp("draft"))
    config = load_model_config(target)
    embed = torch.nn.Parameter(read_checkpoint_tensor(target, "model.embed_tokens.weight", config).float(),
                               requires_grad=False)
    made = []
    for compile_draft in (False, True):
        draft = load_eagle3(draft_path, config, embed, torch.float32)
        made.append(Eagle3Proposer(draft, num_blocks=48, block_size=BLOCK, compile=compile_draft,
                                   num_speculative_tokens=K))
    made[1].warm_up()
    return made


def _requests(positions: list[int], num_positions: list[int], temperatures: list[float], rows_each: list[int],
              tables: list[list[int]]) -> list[DraftRequest]:
    tokens = torch.Generator().manual_seed(sum(positions) + sum(num_positions))
    starts = [sum(rows_each[:i]) for i in range(len(rows_each))]
    return [DraftRequest(f"r{i}", torch.randint(3, 160, (n,), generator=tokens).tolist(), first, start, K, table,
                         temperature, KeyedRandom(i))
            for i, (first, n, temperature, start, table)
            in enumerate(zip(positions, num_positions, temperatures, starts, tables, strict=True))]


def _features(num_rows: int, hidden: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_rows, hidden, generator=gen) for _ in range(3)]


def test_the_compiled_catch_up_and_draft_steps_propose_the_eager_drafts(proposers):
    eager, compiled = proposers
    hidden = compiled.draft.config.target_hidden_size
    prompts = [9, 6, 11]
    tables = [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]  # 24 positions each
    temperatures = [0.0, 0.8, 0.0]
    # The prompts' catch-ups are longer than k + 1: eager in both.
    first = _requests([0, 0, 0], prompts, temperatures, prompts, tables)
    steps = [(first, _features(sum(prompts), hidden, 0))]
    # After one verification each request accepted a different number of drafts (0, 3, 1): its
    # catch-up covers 1, 4 or 2 positions of its k + 1 verified rows.
    steps.append((_requests(prompts, [1, 4, 2], temperatures, [K + 1] * 3, tables), _features(3 * (K + 1), hidden, 1)))
    # One request alone (its own graph), then two; greedy alone, then beside a sampled one.
    steps.append((_requests([10], [3], [0.0], [K + 1], tables[:1]), _features(K + 1, hidden, 2)))
    steps.append((_requests([10, 13], [2, 4], [0.8, 0.0], [K + 1] * 2, tables[1:]), _features(2 * (K + 1), hidden, 3)))
    steps.append((_requests([12, 17], [4, 1], [0.0, 0.0], [K + 1] * 2, tables[1:]), _features(2 * (K + 1), hidden, 4)))
    compilers = (compiled.catch_up_compiler, compiled.decode_compiler, compiled.greedy_proposal_compiler)
    compiles = sum(c.num_compiles for c in compilers)
    for number, (requests, aux) in enumerate(steps):
        calls = compiled.catch_up_compiler.num_calls, compiled.greedy_proposal_compiler.num_calls
        want, got = eager.propose(requests, aux), compiled.propose(requests, aux)
        # Compiled exactly when every catch-up fits k + 1 positions: as one graph with the draft
        # steps when every request is greedy, else the catch-up's own.
        greedy = all(r.temperature == 0 for r in requests)
        assert compiled.catch_up_compiler.num_calls == calls[0] + (number > 0 and not greedy)
        assert compiled.greedy_proposal_compiler.num_calls == calls[1] + (number > 0 and greedy)
        for w, g in zip(want, got, strict=True):
            assert len(g.token_ids) == K and g.token_ids == w.token_ids
            assert (w.probs is None) == (g.probs is None)
            if w.probs is not None:
                torch.testing.assert_close(g.probs, w.probs, atol=1e-5, rtol=1e-4)
    assert not any(c.failed for c in (compiled.compiled_catch_up, compiled.compiled_decode,
                                      compiled.compiled_greedy_proposal))
    assert compiled.decode_compiler.num_calls > 0
    assert sum(c.num_compiles for c in compilers) == compiles
    # The two greedy proposals called the code of the graphs built for them at warm-up directly.
    assert compiled.greedy_proposal_compiler.num_direct_calls == 2
    graphs = (K + 1, 1, GREEDY_PROPOSAL)
    assert set(compiled.graphs.thread_counts) == {(graph, one) for graph in graphs for one in (True, False)}


def test_a_second_start_loads_the_dense_halves_and_proposes_the_eager_drafts(proposers, tmp_path):
    """The dense halves a prompt's catch-up runs are saved whole at warm-up, as the step graphs are: a
    second start over the same draft loads every graph instead of tracing it again."""
    eager, _ = proposers
    target = make_speculation_target(tmp_path / "target")
    config = load_model_config(target)
    embed = torch.nn.Parameter(read_checkpoint_tensor(target, "model.embed_tokens.weight", config).float(),
                               requires_grad=False)  # as the fixture's
    draft = load_eagle3(make_speculation_draft(tmp_path / "draft"), config, embed, torch.float32)
    again = Eagle3Proposer(draft, num_blocks=48, block_size=BLOCK, num_speculative_tokens=K)
    again.warm_up()
    halves = [getattr(again.draft, name).compiled for name in ("before_attention", "after_attention")]
    compilers = [*halves, again.catch_up_compiler, again.decode_compiler, again.greedy_proposal_compiler]
    assert [c.num_compiles for c in compilers] == [0] * 5 and all(c.num_loaded > 0 for c in compilers)
    prompts = [9, 6, 11]
    tables = [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]
    requests = _requests([0, 0, 0], prompts, [0.0, 0.8, 0.0], prompts, tables)
    aux = _features(sum(prompts), again.draft.config.target_hidden_size, 5)
    calls = [half.num_calls for half in halves]
    want, got = eager.propose(requests, aux), again.propose(requests, aux)
    assert all(half.num_calls > before for half, before in zip(halves, calls, strict=True))  # the prompts ran them
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    torch.testing.assert_close(got[1].probs, want[1].probs, atol=1e-5, rtol=1e-4)
    assert [c.num_compiles for c in compilers] == [0] * 5


@pytest.mark.parametrize("batch_sizes", [(1, 2, 4), (1,)], ids=["several", "one at a time"])
def test_only_the_draft_graphs_for_one_request_time_their_thread_count(tmp_path, monkeypatch, batch_sizes):
    """One request's graphs time their own step; each graph of two or more serves every batch, and
    runs with torch's count untimed (workers/compile/cpu_threads.py, as the target's). An engine that runs one
    request at a time (max_num_seqs 1: batch sizes (1,)) builds no graph for several."""
    target = make_speculation_target(tmp_path / "target")
    config = load_model_config(target)
    embed = read_checkpoint_tensor(target, "model.embed_tokens.weight", config).float()
    draft = load_eagle3(make_speculation_draft(tmp_path / "draft"), config, embed, torch.float32)
    proposer = Eagle3Proposer(draft, num_blocks=48, block_size=BLOCK, num_speculative_tokens=K,
                              cuda_graphs=CudaGraphConfig(batch_sizes=batch_sizes))
    timed_rows = []

    def first_rows_of(run):
        """Run the timed step once eagerly; the rows of its first draft forward (the catch-up's
        k + 1 per request, or the decode step's 1), instead of timing it; 1 thread found twice as
        fast as torch's count."""
        rows = []

        def recording(token_ids, features, positions):
            rows.append(token_ids.shape[0])
            return Eagle3Draft.before_attention(draft, token_ids, features, positions)

        compiled_half, draft.before_attention = draft.before_attention, recording
        try:
            run()
        finally:
            draft.before_attention = compiled_half
        timed_rows.append(rows[0])
        return 1, {1: 1.0, torch.get_num_threads(): 2.0}

    monkeypatch.setattr("warpspec.spec_decode.draft_runner.fastest_thread_count", first_rows_of)
    # As on a first start: no saved build to take the count from (workers/compile/step_artifacts.py).
    monkeypatch.setattr(CountingCompiler, "saved_thread_count", lambda self, graph: None)
    # Timing is the subject, not building: the compiled steps are neither built nor run.
    monkeypatch.setattr(DraftGraphs, "_build", lambda self, compiler, inputs, graph: None)
    monkeypatch.setattr(DraftGraphs, "run", lambda self, compiled, inputs, graph: None)
    monkeypatch.setattr(Eagle3Proposer, "_run", lambda self, plan, features: None)
    proposer.warm_up()
    several = batch_sizes != (1,)
    # catch-up, decode step, greedy proposal: one request each.
    assert timed_rows == [K + 1, 1, K + 1]
    graphs = (K + 1, 1, GREEDY_PROPOSAL)
    counts = {(graph, True): 1 for graph in graphs}
    if several:
        counts |= {(graph, False): torch.get_num_threads() for graph in graphs}
    assert torch.get_num_threads() != 1 and proposer.graphs.thread_counts == counts


class Rotate(torch.nn.Module):
    """A half like the draft's before_attention: rows of x times a table whose size (8) is the row
    count the warm-up calls it with."""

    def __init__(self):
        super().__init__()
        self.table = torch.arange(8.0)

    def forward(self, x):
        return x[:, :8] * self.table


def test_a_dynamic_half_warmed_up_at_a_size_equal_to_a_constant_compiles_once_for_every_size():
    """Duck sizing gave rows equal to the table's size one symbol, which the table then fixed to 8:
    the first prompt of another length compiled on the request path."""
    torch._dynamo.reset()
    module = Rotate()
    half = CompiledWithFallback(module.forward, "a half")
    before = fx_graph_cache_counts()
    for rows in (8, 62, 5):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(half(x), module(x))
    hits, misses = fx_graph_cache_counts()
    assert (hits - before[0]) + (misses - before[1]) == 1 and not half.failed
