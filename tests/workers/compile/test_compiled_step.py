"""Compiled CPU steps: which steps run compiled, that they compute what the eager step computes (KV
cache included), and that the graphs are built at start-up and never again."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import weakref

import pytest
import torch

from helpers.hf_checkpoints import make_text_checkpoint
from helpers.steps import build_step
from warpspec import LLM, SamplingParams
from warpspec.workers.compile.compiled_step import CompiledStepRunner, CountingCompiler
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep, StepInput

BLOCK = 4
SHAPES = CudaGraphConfig(batch_sizes=(1, 2, 4), query_lens=(1, 4), max_model_len=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Top-2 routing over every layer's experts, chunked attention shorter than the contexts used; a
    # chunked layer, then a NoPE one: two layers, as a graph costs about 2.5 s per layer to build.
    return make_text_checkpoint(tmp_path_factory.mktemp("compiled"), num_hidden_layers=2, no_rope_layers=[1, 0],
                                interleave_moe_layer_step=1, num_experts_per_tok=2, attention_chunk_size=8)


@pytest.fixture(scope="module")
def runners(checkpoint):
    """(eager, compiled) runners over the same weights and equally sized caches."""
    cache = CacheConfig(block_size=BLOCK, num_blocks=24)
    eager = ModelRunner(checkpoint, "float32", cache)
    compiled = ModelRunner(checkpoint, "float32", cache, cuda_graphs=SHAPES)
    assert isinstance(compiled.graph_runner, CompiledStepRunner)
    return eager, compiled


def _prompts(lengths: list[int]) -> list[list[int]]:
    return [torch.randint(3, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def _tables(lengths: list[int], new_tokens: int) -> list[list[int]]:
    """Disjoint blocks covering each sequence after new_tokens more: [9, 2] + 1 -> [[0, 1, 2], [3]]."""
    tables, next_block = [], 0
    for n in lengths:
        num_blocks = -(-(n + new_tokens) // BLOCK)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    return tables


def test_only_uniform_steps_within_the_shapes_run_compiled():
    runner = CompiledStepRunner(model=None, config=SHAPES, block_size=BLOCK)
    decode = StepInput.build([SequenceStep([5], 3, [0], 0), SequenceStep([6], 7, [1, 2], 0)], BLOCK)
    verify = StepInput.build([SequenceStep([5, 6, 7, 8], 3, [0, 1], 0)], BLOCK)
    mixed = StepInput.build([SequenceStep([5], 3, [0], 0), SequenceStep([6, 7], 0, [1], 0)], BLOCK)
    prefill_tail = StepInput.build([SequenceStep([5, 6], 0, [0], 1)], BLOCK)
    odd_query = StepInput.build([SequenceStep([5, 6], 3, [0, 1], 0)], BLOCK)  # 2 tokens: not in query_lens
    # Beyond the largest CUDA-graph size: the graph of two or more sequences serves any batch.
    many = StepInput.build([SequenceStep([5], 3, [i], 0) for i in range(5)], BLOCK)
    too_long = StepInput.build([SequenceStep([5], 64, list(range(17)), 0)], BLOCK)  # past max_model_len
    assert runner.runs_compiled(decode) and runner.runs_compiled(verify) and runner.runs_compiled(many)
    for step in (mixed, prefill_tail, odd_query, too_long):
        assert not runner.runs_compiled(step)
    # An engine that runs one sequence at a time (max_num_seqs 1) has no graph for several.
    one_at_a_time = CompiledStepRunner(model=None, config=dataclasses.replace(SHAPES, batch_sizes=(1,)),
                                       block_size=BLOCK)
    assert one_at_a_time.runs_compiled(verify) and not one_at_a_time.runs_compiled(decode)
    assert [step.seq_lens.shape[0] for step in one_at_a_time.warm_up_steps([])] == [1, 1]  # query lengths 1, 4


@pytest.mark.slow
@pytest.mark.parametrize("lengths,query_len", [([9], 1), ([9, 2, 14], 1), ([6, 11], 4)])
def test_compiled_step_matches_the_eager_step_and_writes_the_same_cache(runners, lengths, query_len):
    eager, compiled = runners
    tables = _tables(lengths, query_len)
    prompts = _prompts(lengths)
    new_tokens = [p[-query_len:][::-1] for p in prompts]
    outputs = []
    for runner in (eager, compiled):
        for cache in runner.kv_caches:
            cache.zero_()
        pointers = [cache.data_ptr() for cache in runner.kv_caches]
        runner.execute(build_step(runner, [SequenceStep(p, 0, t, 0) for p, t in zip(prompts, tables, strict=True)]))
        step = build_step(runner, [SequenceStep(n, len(p), t, 0)
                                   for p, t, n in zip(prompts, tables, new_tokens, strict=True)], [0, 1])
        output = runner.execute(step)
        assert [cache.data_ptr() for cache in runner.kv_caches] == pointers
        outputs.append(output)
    num_blocks = eager.num_blocks
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, atol=1e-5, rtol=1e-5)
    for got, want in zip(outputs[1].aux_hidden, outputs[0].aux_hidden, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(compiled.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(got[:, :num_blocks], want, atol=1e-5, rtol=1e-5)
    assert compiled.graph_runner.num_compiled_steps >= 1


@pytest.mark.slow
def test_a_long_generation_compiles_nothing_after_start_up_and_emits_the_eager_tokens(checkpoint):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    prompts = _prompts([5, 12, 30])
    tokens = {}
    for enforce_eager in (True, False):
        with LLM(str(checkpoint), dtype="float32", block_size=BLOCK, enforce_eager=enforce_eager) as llm:
            graph_runner = llm.engine.executor.runner.graph_runner
            # Built or loaded from the compile cache at start-up: decode for one sequence and for more.
            warm_compiles = graph_runner.num_compiles if graph_runner else 0
            warm_graphs = warm_compiles + graph_runner.compiled.num_loaded if graph_runner else 0
            assert warm_graphs == (0 if enforce_eager else 2)
            # Start-up reports the compile as a phase of its own, both graphs in it (from the cache or not).
            phases = ["weights and KV cache", *([] if enforce_eager else ["compile target steps"]), "warm-up prompt"]
            assert [p.name for p in llm.startup] == phases
            if not enforce_eager:
                loaded, compiled = re.fullmatch(r"rank 0: (\d+) graphs loaded from the compile cache, (\d+) compiled",
                                                llm.startup[1].detail).groups()
                assert int(loaded) + int(compiled) == 2
            tokens[enforce_eager] = [o.token_ids for o in llm.generate(prompts[:1], params)]
            tokens[enforce_eager] += [o.token_ids for o in llm.generate(prompts, params)]
            if not enforce_eager:
                # 199 decode steps at batch 1 and 199 at batch 3 (prefills run eagerly), with no
                # graph built after start-up.
                assert graph_runner.num_compiled_steps == 2 + 2 * 199
                assert graph_runner.num_compiles == warm_compiles
                # Each decode step through the code dynamo made for its graph, called directly (the 2
                # start-up steps built the graphs).
                assert graph_runner.compiled.num_direct_calls == 2 * 199
                model = weakref.ref(llm.engine.executor.runner.model)
    assert tokens[False] == tokens[True]
    # Dynamo keeps the compiler's backend for the life of the process: it must not keep the model.
    del llm, graph_runner
    gc.collect()
    assert model() is None


def test_one_sequence_at_a_time_builds_only_its_graph(checkpoint):
    """max_num_seqs 1: start-up builds (or loads) the one-sequence graph alone; two prompts, run one
    after the other, decode through it to the eager tokens."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts([5, 12])
    tokens = {}
    for enforce_eager in (True, False):
        with LLM(str(checkpoint), dtype="float32", block_size=BLOCK, max_num_seqs=1,
                 enforce_eager=enforce_eager) as llm:
            tokens[enforce_eager] = [o.token_ids for o in llm.generate(prompts, params)]
            if not enforce_eager:
                graph_runner = llm.engine.executor.runner.graph_runner
                assert graph_runner.num_compiles + graph_runner.compiled.num_loaded == 1
                assert graph_runner.num_compiled_steps == 1 + 2 * 11  # warm-up, then every decode step
    assert tokens[False] == tokens[True]


# Run in a fresh process: every compiled test in this one adds graphs for the same code, and a runner
# checks only the distinguishing guards while every graph for its code is its own.
SEALED_RUN = """
import json, sys
from warpspec import LLM, SamplingParams
first, second, run_dir = sys.argv[1:]
params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
prompts = [[5, 9, 13], [7, 11, 3, 8, 21, 30]]
options = dict(dtype="float32", block_size=4, enforce_eager=False, run_dir=run_dir, cuda_graph_batch_sizes=(1, 2))
with LLM(first, **options) as llm:
    runner = llm.engine.executor.runner.graph_runner
    compiles, owned = runner.num_compiles, runner.compiled.sealed and runner.compiled.owns_every_graph()
    alone = [o.token_ids for o in llm.generate(prompts[:1], params) + llm.generate(prompts, params)]
    built = runner.num_compiles - compiles
    direct_alone = runner.compiled.num_direct_calls
    with LLM(second, **options) as other:  # another model compiles the same step function
        other.generate(prompts[:1], params)
        still_owned = runner.compiled.owns_every_graph()
        after = [o.token_ids for o in llm.generate(prompts, params)]
    direct_after = runner.compiled.num_direct_calls - direct_alone
print(json.dumps(dict(owned=owned, built=built, still_owned=still_owned, alone=alone, after=after,
                      direct_alone=direct_alone, direct_after=direct_after)))
"""


@pytest.mark.slow
def test_after_start_up_steps_call_their_graphs_directly_beside_another_model_and_emit_the_eager_tokens(
        checkpoint, tmp_path):
    other = make_text_checkpoint(tmp_path / "other", hidden_size=32, head_dim=8, num_hidden_layers=1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 13], [7, 11, 3, 8, 21, 30]]
    with LLM(str(checkpoint), dtype="float32", block_size=BLOCK, enforce_eager=True) as llm:
        eager = [o.token_ids for o in llm.generate(prompts[:1], params) + llm.generate(prompts, params)]
    # The session's compile cache too: the graphs this module's checkpoint needs are built once.
    env = {k: v for k, v in os.environ.items() if k != "WARPSPEC_ENFORCE_EAGER"}
    run = subprocess.run([sys.executable, "-c", SEALED_RUN, str(checkpoint), str(other), str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # Sealed at start-up, owning every graph: batch 1 and batch 2 decode picked by size alone, with
    # nothing built after start-up, and the eager tokens.
    assert result["owned"] and result["built"] == 0
    assert result["alone"] == eager[:1] + eager[1:]
    # Sealed: every decode step (39 at batch 1, 39 at batch 2) called its graph's code directly.
    assert result["direct_alone"] == 2 * 39
    # Another model compiling the same step function: its graphs go to its own copy of the code, and
    # this runner's steps still call their own graphs directly (39 more), with the right tokens.
    assert result["still_owned"]
    assert result["direct_after"] == 39
    assert result["after"] == eager[1:]


def scale_and_shift(x, scale: int):
    return x * scale + 1


def shift_then_break(x):
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


def test_a_sealed_call_that_names_its_graph_runs_the_code_dynamo_made_for_that_graph():
    compiled = CountingCompiler(scale_and_shift)
    x = torch.randn(4)
    for scale in (2, 3):  # an int argument is a constant of its graph: two graphs
        torch.testing.assert_close(compiled(x, scale, graph=scale), x * scale + 1)
    assert compiled.num_compiles == 2 and set(compiled.direct_calls) == {2, 3}
    compiled.seal()
    for scale in (3, 2, 3):  # each key's own code: the other graph would scale by the other constant
        torch.testing.assert_close(compiled(x, scale, graph=scale), x * scale + 1)
    assert compiled.num_direct_calls == 3 and compiled.num_compiles == 2
    # No key: through torch.compile.
    torch.testing.assert_close(compiled(x, 2), x * 2 + 1)
    assert compiled.num_direct_calls == 3 and compiled.num_calls == 6
    # A second instance for the same function builds and calls its own graphs directly too, in its own
    # copy of the code.
    second = CountingCompiler(scale_and_shift)
    for scale in (3, 2):
        second(x, scale, graph=scale)
    second.seal()
    for scale in (2, 3):
        torch.testing.assert_close(second(x, scale, graph=scale), x * scale + 1)
    assert second.num_direct_calls == 2


def test_each_compiler_compiles_its_own_copy_of_the_code_past_dynamos_recompile_limit():
    """Dynamo stops compiling a code object after recompile_limit graphs and runs it eagerly: engines
    sharing one step function would, past the limit, silently step eagerly."""
    x = torch.randn(4)
    with torch._dynamo.config.patch(recompile_limit=2):
        compilers = [CountingCompiler(scale_and_shift) for _ in range(3)]
        for scale, compiled in enumerate(compilers, start=5):  # a graph of its own each
            torch.testing.assert_close(compiled(x, scale, graph="step"), x * scale + 1)
    assert [c.num_compiles for c in compilers] == [1, 1, 1]
    assert all(c.owns_every_graph() and "step" in c.direct_calls for c in compilers)


def test_code_that_resumes_after_a_graph_break_is_not_called_directly():
    """Its second half is a function dynamo compiles when its frame runs: called outside
    torch.compile it would run eagerly."""
    compiled = CountingCompiler(shift_then_break)
    x = torch.randn(4)
    compiled(x, graph="step")
    compiled.seal()
    torch.testing.assert_close(compiled(x, graph="step"), (x + 1) * 2)
    assert compiled.num_compiles == 2 and not compiled.direct_calls and compiled.num_direct_calls == 0


class ThreadRecorder:
    """Wraps a compiled step, noting the thread count of every call."""

    def __init__(self, compiled):
        self.compiled, self.counts = compiled, []

    def __call__(self, *args, **kwargs):
        self.counts.append(torch.get_num_threads())
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def test_each_graph_runs_with_the_thread_count_chosen_for_it_at_start_up(checkpoint, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # One sequence's decode graph: 1 thread, as if the eager timing had found it twice as fast as
        # 2, the only one timed; more sequences': torch's 2 (workers/compile/cpu_threads.py).
        timed = []
        monkeypatch.setattr("warpspec.workers.runner.fastest_thread_count",
                            lambda run: (timed.append(run) or 1, {1: 1.0, 2: 2.0}))
        # As on a first start: no saved build to take the count from (workers/compile/step_artifacts.py).
        monkeypatch.setattr(CompiledStepRunner, "saved_thread_count", lambda self, step: None)
        runner = ModelRunner(checkpoint, "float32", CacheConfig(block_size=BLOCK, num_blocks=16),
                             cuda_graphs=CudaGraphConfig(batch_sizes=(1, 2), query_lens=(1,), max_model_len=64))
        runner.warm_up([])
        assert runner.graph_runner.thread_counts == {(1, True): 1, (1, False): 2} and len(timed) == 1
        recorder = runner.graph_runner.compiled = ThreadRecorder(runner.graph_runner.compiled)
        compiles = runner.graph_runner.num_compiles
        one = build_step(runner, [SequenceStep([5], 3, [0], 0)])
        two = build_step(runner, [SequenceStep([5], 3, [0], 0), SequenceStep([6], 7, [1, 2], 0)])
        for step in (one, two, one):
            runner.execute(step)
            assert torch.get_num_threads() == 2  # restored after the step
        assert recorder.counts == [1, 2, 1]
        assert runner.graph_runner.num_compiles == compiles  # each graph was built with its count
        # A later start takes each graph's count from its saved build, without timing.
        monkeypatch.undo()
        monkeypatch.setattr("warpspec.workers.runner.fastest_thread_count", lambda run: pytest.fail("timed"))
        again = ModelRunner(checkpoint, "float32", CacheConfig(block_size=BLOCK, num_blocks=16),
                            cuda_graphs=CudaGraphConfig(batch_sizes=(1, 2), query_lens=(1,), max_model_len=64))
        again.warm_up([])
        assert again.graph_runner.thread_counts == {(1, True): 1, (1, False): 2}
        assert (again.graph_runner.num_compiles, again.graph_runner.compiled.num_loaded) == (0, 2)
        # A target serving a draft returns aux layers' hidden states: another graph, saved apart, so
        # that a plain start and a start with the draft do not replace each other's files.
        with_aux = build_step(again, [SequenceStep([5], 3, [0], 0)], [1])
        assert again.graph_runner.saved_thread_count(one) == 1
        assert again.graph_runner.saved_thread_count(with_aux) is None
    finally:
        torch.set_num_threads(before)
