"""Prompt lookup drafts (speculative_method="ngram"): the lookup finds the longest, then the latest,
earlier occurrence of the text's suffix; the proposer follows each request's text as it grows and
keeps only the run a grammar allows; through the engine greedy output is what it is without drafts,
sampled output keeps the target's distribution, and a seeded request reads the same in any crowd."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.eagle3_checkpoints import make_speculation_target
from warpspec import LLM, SamplingParams
from warpspec.assets import BUNDLED_TARGET
from warpspec.config.engine import SPECULATIVE_METHODS, SpeculativeConfig
from warpspec.sample.keyed_random import KeyedRandom
from warpspec.sample.rejection_sampler import verify
from warpspec.sampling_params import StructuredOutputs
from warpspec.spec_decode.methods import PROPOSERS
from warpspec.spec_decode.ngram import NgramProposer, lookup
from warpspec.spec_decode.proposer import DraftRequest
from warpspec.structured_output.grammar import GrammarCompiler
from warpspec.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _lookup(tokens: list[int], min_n: int = 2, max_n: int = 5, k: int = 3) -> list[int]:
    return lookup(np.array(tokens), min_n, max_n, k)


def test_the_longest_suffix_found_proposes_and_among_equals_the_latest():
    # [1 2 3] ends at 3 (after it: 8 0 2); only [2 3] also ends at 7 (after it: 6 1 2).
    text = [5, 1, 2, 3, 8, 0, 2, 3, 6, 1, 2, 3]
    assert _lookup(text) == [8, 0, 2]
    assert _lookup(text, max_n=2) == [6, 1, 2]  # two tokens at most: the latest of the matches
    assert _lookup(text, k=5) == [8, 0, 2, 3, 6]
    # No earlier [x 4]: a one-token match counts only with min_n 1; what follows may reach the end.
    assert _lookup([4, 9, 7, 4]) == [] and _lookup([4, 9, 7, 4], min_n=1) == [9, 7, 4]
    assert _lookup([7]) == [] and _lookup([3, 3], min_n=1) == [3]


def _request(request_id: str, context: list[int], first: int, num_drafts: int = 3, grammar=None) -> DraftRequest:
    """The engine's request after a step that computed positions first .. len(context) - 2."""
    return DraftRequest(request_id, context[first + 1 :], first, 0, num_drafts, [], 0.0, KeyedRandom(0),
                        grammar=grammar, context=context)


def test_the_proposer_follows_each_requests_text_as_it_grows():
    proposer = NgramProposer(2, 5)
    text = [5, 6, 7, 8, 5, 6]
    # The first call starts mid-text (a prefix-cache hit): the cached tokens come from the context.
    assert proposer.propose([_request("a", text, 3)], [])[0].token_ids == [7, 8, 5]
    text += [7, 9, 5]  # accepted 7, the target chose 9 (a rejection), then 5
    assert proposer.propose([_request("a", text, 5, num_drafts=0)], [])[0].token_ids == []
    assert proposer.texts["a"][1] == len(text)
    text += [6]
    assert proposer.propose([_request("a", text, 8)], [])[0].token_ids == [7, 9, 5]  # the latest [5 6]
    proposer.release(["a"])
    assert "a" not in proposer.texts
    # A long prompt grows the buffer past doubling; what it holds is the text.
    long = list(range(3, 300)) + [10, 11]
    assert proposer.propose([_request("b", long, 0)], [])[0].token_ids == [12, 13, 14]
    assert proposer.texts["b"][0][: len(long)].tolist() == long


def test_a_grammar_keeps_the_run_it_allows_and_stays_where_it_was():
    tokenizer = Tokenizer.from_dir(BUNDLED_TARGET)
    compiler = GrammarCompiler(tokenizer.hf.to_str(), tokenizer.vocab_size, [2])
    matcher = compiler.matcher(StructuredOutputs(regex="(ab)+c"))
    a, b, c = (tokenizer.hf.encode(x, add_special_tokens=False).ids for x in "abc")
    assert len(a) == len(b) == len(c) == 1
    a, b, c = a[0], b[0], c[0]
    assert matcher.consume_tokens([a, b, a])
    # [a] last occurred at 2, followed by [b c a]: after "aba" the grammar allows "bc", then only eos.
    drafts = NgramProposer(1, 1).propose([_request("g", [a, b, a, b, c, a], 4, grammar=matcher)], [])
    assert drafts[0].token_ids == [b, c]
    # [a] last occurred at 1, followed by [b b]: b is allowed, then b again is not.
    refused = NgramProposer(1, 1).propose([_request("g", [a, a, b, b, a], 3, num_drafts=2, grammar=matcher)], [])
    assert refused[0].token_ids == [b]
    assert matcher.consume_token(b) and not matcher.is_error()  # left after "aba"


def test_deterministic_drafts_keep_the_target_distribution():
    """A sampled request verifying a deterministic draft (no q: all its mass on the draft) emits its
    first token as the target's p, whichever token is drafted."""
    p_logits = torch.log(torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0)
    trials = 6000
    for draft in (1, 4):  # a likely and an unlikely draft
        counts = torch.zeros(5)
        for trial in range(trials):
            tokens = verify(torch.stack([p_logits, p_logits]), [draft], None, params, KeyedRandom(trial), 0)
            counts[tokens[0]] += 1
        expected = torch.softmax(p_logits, -1) * trials
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 18.47, draft  # the 0.1% point of chi-square with 4 degrees of freedom


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_speculation_target(tmp_path_factory.mktemp("target"))


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (a phrase said three times, then its start), as agents' do,
    and two that do not."""
    generator = torch.Generator().manual_seed(0)
    phrases = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (6, 9, 13)]
    return [p * 3 + p[:3] for p in phrases] + [torch.randint(3, 160, (n,), generator=generator).tolist()
                                                 for n in (4, 21)]


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_greedy_output_is_identical_with_prompt_lookup(target, policy):
    with LLM(str(target), dtype="float32", block_size=4) as llm:
        reference = llm.generate(_prompts(), GREEDY)
    with LLM(str(target), dtype="float32", block_size=4, speculative_method="ngram", num_speculative_tokens=4,
             speculative_policy=policy) as llm:
        outs = llm.generate(_prompts(), GREEDY)
        stats = llm.engine.spec_stats
        left = set(llm.engine.proposer.texts)
        llm.generate(_prompts()[:1], GREEDY)  # the requests that left are released with the next call
        assert left and not left & set(llm.engine.proposer.texts)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_seeded_request_reads_the_same_in_a_crowd(target):
    """Prompt lookup drafts from the request's own text alone, so its draft count at each step, and
    its tokens, do not depend on the crowd: 12 requests in 24 blocks of 4 (preemption, chunked
    prefill, prefix-cache hits on the repeated prompts). Rejection sampling reads each draft as
    certain: accepted with probability p(draft), the residual p without it."""
    # At a low temperature this target repeats itself (its sampled text at 0.9 drafted twice in all).
    seeded = [SamplingParams(max_tokens=32, temperature=0.3, top_k=20, seed=s, ignore_eos=True) for s in range(6)]
    prompts = _prompts() + _prompts()[:1]
    crowd = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24, max_num_seqs=6,
                 speculative_method="ngram", num_speculative_tokens=4)
    with LLM(str(target), dtype="float32", **crowd) as llm:
        alone = [llm.generate([p], s)[0] for p, s in zip(prompts, seeded, strict=True)]
        together = llm.generate(prompts * 2, seeded + [SamplingParams(max_tokens=24, temperature=1.0)] * 6)
        stats = llm.engine.spec_stats
    assert [o.token_ids for o in together[:6]] == [o.token_ids for o in alone]
    assert stats.num_accepted_tokens > 0


def test_each_method_has_a_loader_and_bad_methods_are_refused():
    assert set(PROPOSERS) == set(SPECULATIVE_METHODS)
    assert SpeculativeConfig(draft="d").method == "eagle3" and not SpeculativeConfig().enabled
    with pytest.raises(ValueError, match="speculative_method 'eagle3' needs draft"):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(ValueError, match="draft is read by speculative_method 'eagle3' only, not 'ngram'"):
        SpeculativeConfig(method="ngram", draft="d")
    with pytest.raises(ValueError, match="speculative_method must be one of eagle3, ngram"):
        SpeculativeConfig(method="suffix")
