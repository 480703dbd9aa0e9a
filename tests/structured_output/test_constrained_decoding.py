"""Constrained decoding end to end on the bundled pair (a 10M model: the grammar, not the model,
makes the output parse). The EAGLE-3 draft changes no greedy token, nor a seeded one under coupled
verification, and keeps the constrained distribution under rejection sampling; its own drafts are
masked too, so it still accepts; seeded requests read the same in a crowd as alone. A request waits for
its grammar without holding up the others."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter

import jsonschema
import pytest

from helpers.staggered import count_unfinished_chunks, run_staggered
from warpspec import LLM, SamplingParams
from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.sampling_params import StructuredOutputs
from warpspec.structured_output.grammar import GrammarCompiler

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
SPECS = {"json": StructuredOutputs(json=SCHEMA), "json_object": StructuredOutputs(json_object=True),
         "regex": StructuredOutputs(regex=REGEX), "choice": StructuredOutputs(choice=CHOICES),
         "grammar": StructuredOutputs(grammar='start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[1-9][0-9]?/')}
DRAFT = dict(draft=str(BUNDLED_DRAFT), compile_draft=False)


def greedy(spec: StructuredOutputs) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=0, structured_output=spec)


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", text) is not None


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return held_out_prompts()[:4]


@pytest.fixture(scope="module")
def without_draft(prompts) -> dict[str, list]:
    with LLM(str(BUNDLED_TARGET), dtype="float32") as llm:
        return {kind: llm.generate(prompts, greedy(spec)) for kind, spec in SPECS.items()}


def test_every_greedy_output_follows_its_grammar_and_ends_with_it(without_draft):
    for kind, outs in without_draft.items():
        for out in outs:
            assert out.finish_reason == "stop" and follows(kind, out.text), (kind, out.text)


def test_the_draft_changes_no_greedy_token_and_drafts_under_the_grammar(prompts, without_draft):
    # Fixed k: what a grammar does to the drafts, with no step choosing fewer for its costs.
    with LLM(str(BUNDLED_TARGET), dtype="float32", **DRAFT, speculative_policy="fixed") as llm:
        for kind, spec in SPECS.items():
            outs = llm.generate(prompts, greedy(spec))
            assert [o.token_ids for o in outs] == [o.token_ids for o in without_draft[kind]], kind
            assert all(len(o.token_ids) < 60 for o in outs)  # so max_tokens never cut a request's drafts
        stats = llm.engine.spec_stats
        # Drafts proposed without the grammar's mask accept 1.19 tokens a step here; masked, 2.80.
        assert stats.acceptance_length > 2.2
        # k = 3 drafts at every step, a complete grammar's included: verification stays uniform (compiled).
        assert stats.num_draft_tokens == 3 * stats.num_verify_steps
        # Acceptance under a grammar is reported beside acceptance without one.
        assert stats.constrained_acceptance_length == stats.acceptance_length
        assert llm.engine.stats().constrained_acceptance_length == stats.acceptance_length
        llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        assert stats.free_acceptance_length > 0 and stats.num_constrained_verify_steps < stats.num_verify_steps
        assert stats.constrained_acceptance_length != stats.acceptance_length


def test_seeded_sampling_reads_the_same_with_the_draft_under_coupled_verification(prompts):
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=seed, structured_output=SPECS["json"])
              for seed in range(len(prompts))]
    with LLM(str(BUNDLED_TARGET), dtype="float32") as llm:
        expected = llm.generate(prompts, params)
    with LLM(str(BUNDLED_TARGET), dtype="float32", coupled_verification=True, **DRAFT) as llm:
        got = llm.generate(prompts, params)
        assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_rejection_sampling_keeps_the_constrained_distribution():
    """Two samples of 600 strings of [ab]{4} (16 outcomes, each well populated on this prompt): without
    the draft, and with it (other seeds: the two samples must be independent)."""
    prompt, n = held_out_prompts()[0], 600
    spec = StructuredOutputs(regex="[ab]{4}")
    counts = []
    for options, seeds in (({}, range(n)), (DRAFT, range(n, 2 * n))):
        with LLM(str(BUNDLED_TARGET), dtype="float32", **options) as llm:
            outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=8, temperature=1.0, seed=s,
                                                              structured_output=spec) for s in seeds])
            if options:
                assert llm.engine.spec_stats.num_accepted_tokens > n  # drafts were verified and accepted
        counts.append(Counter(o.text for o in outs))
    outcomes = set(counts[0]) | set(counts[1])
    assert all(re.fullmatch("[ab]{4}", text) for text in outcomes)
    # Chi-square test of homogeneity; equal sample sizes: each cell's expected count is the mean.
    chi2 = sum((c[t] - (counts[0][t] + counts[1][t]) / 2) ** 2 / ((counts[0][t] + counts[1][t]) / 2)
               for t in outcomes for c in counts)
    assert chi2 < 37.70  # the 0.1% point of chi-square with 15 degrees of freedom


def _constrained_crowd(prompts: list[list[int]]) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(request id, prompt, params, the step it arrives at): seeded top-p requests of every grammar, and
    of prose (a grammar that leaves most tokens to the model, so that the drafts' probabilities decide
    more of them than under a schema), half of them opening with the same two prompts (prefix-cache
    hits), with free text beside them. First comes a request with penalties that opens the same way
    and whose prompt fits one step: the draft never drafts for it, and the others hit its blocks. An
    unseeded one samples with whatever lengths the draft-length policy chooses (not compared); its
    prompt of 97 tokens takes two steps of 80."""
    opening = prompts[0] + prompts[1][1:]
    crowd = [("penalties", opening + prompts[2][1:4],
              SamplingParams(max_tokens=40, temperature=0.8, repetition_penalty=1.2, seed=98), 0),
             ("unseeded", prompts[3] + prompts[2][1:] + prompts[1][1:],
              SamplingParams(max_tokens=40, temperature=0.8), 2)]
    kinds = [StructuredOutputs(regex="[a-z ,.]{20,200}"), *SPECS.values()]
    for i, prompt in enumerate(prompts * 2):
        params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=10 + i,
                                structured_output=kinds[i % len(kinds)])
        crowd.append((f"c{i}", opening + prompt[1:] if i % 2 == 0 else prompt, params, 1 + i))
    return crowd


@pytest.mark.parametrize("deterministic", [False, True])
def test_seeded_constrained_requests_read_the_same_in_a_staggered_crowd(prompts, deterministic):
    """Under the default (adaptive) draft length, with prefix-cache hits, preemption (12 blocks of 16
    tokens, far less than the crowd holds at once) and chunked prefill (80 tokens a step), each seeded
    request reads as alone, in float32 and in deterministic mode."""
    options = dict(dtype="float32", deterministic=deterministic, block_size=16, num_kv_blocks=12,
                   max_num_batched_tokens=80, **DRAFT)
    crowd = _constrained_crowd(prompts)
    with LLM(str(BUNDLED_TARGET), enable_prefix_caching=False, **options) as llm:
        alone = {rid: llm.generate([prompt], params)[0].token_ids for rid, prompt, params, _ in crowd
                 if params.seed is not None}
    with LLM(str(BUNDLED_TARGET), **options) as llm:
        engine = llm.engine
        num_chunks = count_unfinished_chunks(engine)
        got = {rid: out.token_ids for rid, out in run_staggered(engine, crowd).items()}
        assert num_chunks[0] > 0 and engine.scheduler.num_preemptions > 0
        assert engine.block_manager.stats.hit_tokens > 0
        assert engine.spec_stats.num_constrained_verify_steps > 0
    assert {rid: got[rid] for rid in alone} == alone


def test_a_request_waits_for_its_grammar_without_holding_up_the_others(monkeypatch):
    """The structured request's matcher is held back until the plain one has finished: the plain one
    runs to the end meanwhile, and then the structured one runs."""
    release = threading.Event()
    build = GrammarCompiler.matcher

    def slow_matcher(self, spec):
        assert release.wait(timeout=60)
        return build(self, spec)

    monkeypatch.setattr(GrammarCompiler, "matcher", slow_matcher)
    with LLM(str(BUNDLED_TARGET), dtype="float32") as llm:
        core = llm.engine
        core.add_request(core.new_request("constrained", "A", greedy(SPECS["choice"])))
        core.add_request(core.new_request("plain", "A", SamplingParams(max_tokens=8, temperature=0)))
        tokens, finished = {"constrained": [], "plain": []}, set()

        def step():
            for delta in core.step():
                tokens[delta.request_id] += delta.new_token_ids
                if delta.finished:
                    finished.add(delta.request_id)

        while "plain" not in finished:
            step()
        assert len(tokens["plain"]) == 8 and not tokens["constrained"]
        assert core.num_waiting == 1 and core.has_unfinished()  # still compiling, and counted as waiting
        release.set()
        while core.has_unfinished():
            step()
        assert "constrained" in finished and llm.tokenizer.decode(tokens["constrained"]) in CHOICES


def test_a_request_aborted_while_its_grammar_builds_leaves_nothing_behind(monkeypatch):
    release = threading.Event()
    build = GrammarCompiler.matcher
    monkeypatch.setattr(GrammarCompiler, "matcher", lambda self, spec: release.wait(60) and build(self, spec))
    with LLM(str(BUNDLED_TARGET), dtype="float32") as llm:
        core = llm.engine
        core.add_request(core.new_request("constrained", "A", greedy(SPECS["json"])))
        assert core.has_unfinished()
        core.abort("constrained")
        release.set()
        assert not core.has_unfinished() and core.step() == [] and core.num_waiting == 0
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
