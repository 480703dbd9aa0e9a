"""Speculative decoding is lossless: greedy output is token-for-token what it is without drafts, and
sampled output follows the target's distribution."""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref

import pytest
import torch

from helpers.eagle3_checkpoints import make_eagle3_checkpoint, make_speculation_draft, make_speculation_target
from warpspec import LLM, SamplingParams
from warpspec.client.ray_client import RayCoreClient
from warpspec.errors import InvalidRequestError
from warpspec.sample.keyed_random import KeyedRandom
from warpspec.sample.rejection_sampler import verify
from warpspec.serving.metrics import AcceptanceWatch
from warpspec.spec_decode.draft_runner import scratch_reserve
from warpspec.spec_decode.proposer import DraftRequest, Drafts
from warpspec.workers.compile.step_artifacts import graphs_built
from warpspec.workers.errors import CheckpointError
from warpspec.workers.models.eagle3_draft import Eagle3Config
from warpspec.workers.models.registry import load_model_config

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_speculation_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_speculation_draft(tmp_path_factory.mktemp("draft"))


def _prompts(lengths=(5, 17, 30, 1, 9)) -> list[list[int]]:
    return [torch.randint(3, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(target):
    """Greedy without the draft, on a full KV cache: the target's chunk (8) is shorter than the
    prompts, so the engines with the draft below keep the hybrid cache; their tokens must be these."""
    with LLM(str(target), dtype="float32", hybrid_kv_cache=False) as llm:
        return llm.generate(_prompts(), GREEDY)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_eagle3_greedy_is_identical_without_and_with_speculation(target, draft, reference, enforce_eager):
    """Compiled: the target's decode and k+1-token verification steps run compiled."""
    with LLM(str(target), dtype="float32", draft=str(draft), compile_draft=False, num_speculative_tokens=3,
             block_size=4, max_num_batched_tokens=24, enforce_eager=enforce_eager) as llm:
        outs = llm.generate(_prompts(), GREEDY)
        stats = llm.engine.spec_stats
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        assert llm.engine.kv_layout.is_hybrid and llm.engine.block_manager.num_released_blocks > 0
        graph_runner = llm.engine.executor.runner.graph_runner
        assert (graph_runner is None) == enforce_eager
        if graph_runner is not None:
            # At most decode and verification, each for one sequence and for more.
            assert graph_runner.num_compiled_steps > 0 and graph_runner.num_compiles <= 4
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert stats.num_verify_steps > 0 and stats.num_draft_tokens > 0
    assert all("acceptance_length" in o.metrics for o in outs)


def test_the_drafts_scratch_blocks_are_made_at_start_and_its_cache_never_grows(target, draft):
    """A crowd at max_num_seqs drafts into the scratch blocks made at start-up (scratch_reserve):
    growing the draft's cache would copy all of it, GiBs for a small model's default cache."""
    with LLM(str(target), dtype="float32", draft=str(draft), compile_draft=False, num_speculative_tokens=3,
             block_size=4, max_num_seqs=5, enforce_eager=True) as llm:
        cache = llm.engine.proposer.draft.kv_cache
        assert cache.shape[1] == llm.engine.block_manager.num_blocks + scratch_reserve(5, 3, 4)
        llm.generate(_prompts(), GREEDY)
        assert llm.engine.spec_stats.num_verify_steps > 0 and llm.engine.proposer.draft.kv_cache is cache


def test_engine_stats_count_drafts_and_accepts_per_draft_position(target, draft):
    """What the replica's per-position counters and its last-minute acceptance read (metrics.py). This
    random draft is no draft of this target: it accepts next to nothing, which the watch flags. Fixed
    k: the adaptive policy would soon stop drafting with it, leaving the watch too few verifications."""
    with LLM(str(target), dtype="float32", draft=str(draft), compile_draft=False, num_speculative_tokens=3,
             enforce_eager=True, speculative_policy="fixed") as llm:
        llm.generate(_prompts(), GREEDY)
        spec, core = llm.engine.spec_stats, llm.engine.stats()
    assert len(core.drafted_at) == len(core.accepted_at) == 3
    # Every verification drafts a first token; a draft is accepted only after those before it.
    assert core.drafted_at[0] == spec.num_verify_steps and sum(core.drafted_at) == spec.num_draft_tokens
    assert sum(core.accepted_at) == spec.num_accepted_tokens
    assert list(core.accepted_at) == sorted(core.accepted_at, reverse=True)
    assert all(a <= d for a, d in zip(core.accepted_at, core.drafted_at, strict=True))
    assert 0 < core.draft_share < 1
    watch = AcceptanceWatch(min_acceptance_length=1.3, min_verify_steps=64)
    watch.update(0.0, (), ())
    recent = watch.update(1.0, core.drafted_at, core.accepted_at)
    assert recent == pytest.approx(spec.acceptance_length) and recent < 1.3 and watch.is_low(recent)


class ScriptedProposer:
    """Proposes each request's known greedy continuation, corrupted at random positions: drives
    full accepts (bonus tokens), partial accepts and rollbacks across block boundaries. It asks the
    target for the hidden states of aux_layer_ids and ignores them."""

    def __init__(self, continuations: dict[str, list[int]], prompt_lens: dict[str, int], error_rate: float,
                 seed: int = 0, aux_layer_ids: tuple[int, ...] = ()):
        self.continuations, self.prompt_lens = continuations, prompt_lens
        self.aux_layer_ids = aux_layer_ids
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def propose(self, requests: list[DraftRequest], aux_hidden) -> list[Drafts]:
        out = []
        for r in requests:
            # The request's tokens end at position first_position + num_positions (the newest one).
            done = r.first_position + r.num_positions + 1 - self.prompt_lens[r.request_id]
            drafts = list(self.continuations[r.request_id][done : done + r.num_drafts])
            for i in range(len(drafts)):
                if self.rng.random() < self.error_rate:
                    drafts[i] = (drafts[i] + 1) % 160
            out.append(Drafts(drafts))
        return out

    def release(self, request_ids: list[str]) -> None:
        pass


def scripted(reference, error_rate: float, aux_layer_ids: tuple[int, ...] = ()) -> ScriptedProposer:
    ids = [f"offline-{i}" for i in range(len(reference))]
    return ScriptedProposer(dict(zip(ids, (r.token_ids for r in reference), strict=True)),
                            dict(zip(ids, map(len, _prompts()), strict=True)), error_rate, aux_layer_ids=aux_layer_ids)



def test_the_adaptive_policy_drives_a_proposer_that_reads_no_features(target, reference):
    """A proposer without aux layers gets no target features. Under the adaptive policy a request
    that drafts nothing (here: opted out) keeps a backlog of its features for the draft; with none to
    keep, the proposer hears every step instead (joining no features failed the step)."""
    params = [GREEDY] * 4 + [dataclasses.replace(GREEDY, speculation=False)]
    with LLM(str(target), dtype="float32", num_speculative_tokens=3, block_size=4, enforce_eager=True,
             proposer=scripted(reference, 0.3), speculative_policy="adaptive") as llm:
        outs = llm.generate(_prompts(), params)
        stats = llm.engine.spec_stats
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert stats.num_verify_steps > 0 and "acceptance_length" not in outs[-1].metrics


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_accepts_and_rollbacks_keep_greedy_output_exact(target, draft, reference, error_rate, enforce_eager):
    # Eager, k=4: a verification of k + 1 tokens spans more than one block. Compiled, the compiled
    # greedy test's configuration (k=3, the draft's layers read, the same batch budget): the target's
    # steps are the graphs that test saved (step_artifacts.py), loaded instead of compiled again.
    k = 4 if enforce_eager else 3
    aux_layer_ids = () if enforce_eager else \
        Eagle3Config.from_pretrained(draft, load_model_config(target)).aux_layer_ids
    with LLM(str(target), dtype="float32", num_speculative_tokens=k, block_size=4, max_num_batched_tokens=24,
             proposer=scripted(reference, error_rate, aux_layer_ids), enforce_eager=enforce_eager) as llm:
        outs = llm.generate(_prompts(), GREEDY)
        stats = llm.engine.spec_stats
        manager = llm.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert stats.num_accepted_tokens > 0
    if error_rate == 0.0:
        # Every draft is right: k accepted + 1 bonus per step, except where max_tokens cuts drafting short.
        assert stats.acceptance_length > k
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_drafts_never_cross_max_tokens_or_stop_tokens(target, reference):
    stop = reference[2].token_ids[6]
    first_stop = reference[2].token_ids.index(stop)
    with LLM(str(target), dtype="float32", num_speculative_tokens=4, proposer=scripted(reference, 0.0)) as llm:
        outs = llm.generate(_prompts(), SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]))
    assert outs[2].token_ids == reference[2].token_ids[: min(first_stop + 1, 10)]
    assert all(len(o.token_ids) <= 10 for o in outs)


def test_rejection_sampling_emits_the_target_distribution():
    """Whatever the draft's q, the first emitted token is distributed as the target's p."""
    p_logits = torch.log(torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1]))
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    trials = 6000
    for trial in range(trials):
        draft = int(torch.multinomial(q, 1, generator=generator))
        tokens = verify(torch.stack([p_logits, p_logits]), [draft], q[None], params, KeyedRandom(trial), 0)
        counts[tokens[0]] += 1
    expected = torch.softmax(p_logits, -1) * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # the 0.1% point of chi-square with 4 degrees of freedom


def test_sampled_speculation_runs_to_length(target, draft):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    with LLM(str(target), dtype="float32", draft=str(draft)) as llm:
        outs = llm.generate(_prompts(), params)
        again = llm.generate(_prompts(), params)
    assert all(len(o.token_ids) == 20 for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]  # seeded: reproducible


def test_public_checkpoint_layer_id_conventions(target, tmp_path):
    config = load_model_config(target)
    default = make_eagle3_checkpoint(tmp_path / "default", hidden=64, vocab=160, draft_vocab=32)
    # (2, L // 2, L - 3), on a deeper target (L = 8) where the three differ.
    deeper = dataclasses.replace(config, num_hidden_layers=8, no_rope_layers=config.no_rope_layers * 2)
    assert Eagle3Config.from_pretrained(default, deeper).aux_layer_ids == (2, 4, 5)
    declared = make_eagle3_checkpoint(tmp_path / "declared", hidden=64, vocab=160, draft_vocab=32,
                                      aux_layer_ids=[1, 2, 3], with_embeddings=True)
    assert Eagle3Config.from_pretrained(declared, config).aux_layer_ids == (1, 2, 3)
    assert Eagle3Config.from_pretrained(declared, config, aux_layer_offset=1).aux_layer_ids == (2, 3, 4)
    # The declared draft carries embed_tokens, which warpspec ignores in favour of the target's.
    with LLM(str(target), dtype="float32", draft=str(declared), compile_draft=False) as llm:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 24


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden=32), "draft expects target hidden size 32, the target has 64"),
    (dict(vocab=200), "draft vocab_size 200 differs from the target's 160"),
])
def test_mismatched_drafts_are_refused(target, tmp_path, kwargs, message):
    args = dict(hidden=64, vocab=160, draft_vocab=32) | kwargs
    path = make_eagle3_checkpoint(tmp_path / "bad", **args)
    with pytest.raises(CheckpointError, match=message):
        LLM(str(target), dtype="float32", draft=str(path), compile_draft=False)


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_speculation_over_ray_workers(ray_cluster, target, draft, reference, method):
    """The engine core and the drafter run in the coordinator actor: EAGLE-3 on the hidden states
    rank 0 returns through the compiled graph, with the target's embedding table read from the
    checkpoint (workers hold only shards); prompt lookup on the tokens alone. The replica gets token
    ids back."""
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    drafter = dict(draft=str(draft), compile_draft=False) if method == "eagle3" else dict(speculative_method=method)
    with LLM(str(target), dtype="float32", num_workers=2, **drafter) as llm:
        assert isinstance(llm.engine, RayCoreClient)
        assert bool(llm.engine.coordinator.info.draft_aux_layer_ids) == (method == "eagle3")
        outs = llm.generate(_prompts(), GREEDY)
        assert llm.engine.spec_stats.num_verify_steps > 0
        # A seeded sampled request is reproducible whatever else is in its batch, with the drafts
        # sampled in the coordinator.
        alone = llm.generate([_prompts()[1]], sampled)[0]
        batched = llm.generate(_prompts(), [GREEDY] + [sampled] + [GREEDY] * 3)[1]
        stats = llm.engine.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert alone.token_ids == batched.token_ids and len(alone.token_ids) == 12


@pytest.mark.slow
def test_compiled_draft_is_still_lossless(target, draft, reference):
    # block_size=4, as the compiled greedy test above: the target's steps are then the graphs that test
    # saved (step_artifacts.py), loaded instead of compiled again; the draft's are this test's own.
    with LLM(str(target), dtype="float32", draft=str(draft), num_speculative_tokens=3, block_size=4,
             enforce_eager=False) as llm:
        built = graphs_built()  # by start-up: every graph built or loaded
        outs = llm.generate(_prompts(), GREEDY)
        llm.generate(_prompts()[:2], SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True))
        # Nothing compiled or loaded on the request path, greedy or sampled, alone or batched.
        assert graphs_built() == built
        proposer = llm.engine.proposer
        assert not proposer.draft.before_attention.failed  # it really ran compiled
        # The single-token draft steps ran as one graph each for one request and for more; greedy
        # drafting ran the whole proposal as one graph while every request wanted all k drafts.
        assert not proposer.compiled_decode.failed and proposer.decode_compiler.num_calls > 0
        assert proposer.decode_compiler.num_compiles <= 2
        assert not proposer.compiled_greedy_proposal.failed and proposer.greedy_proposal_compiler.num_calls > 0
        assert proposer.greedy_proposal_compiler.num_compiles <= 2
        models = weakref.ref(llm.engine.executor.runner.model), weakref.ref(proposer.draft)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    # Shut down, the engine frees both models: dynamo keeps every compiler backend for the life of the
    # process, and one that held its compiler strongly kept the target in memory.
    del llm, proposer
    gc.collect()
    assert [model() for model in models] == [None, None]


def test_enforce_eager_leaves_the_draft_uncompiled(target, draft):
    with LLM(str(target), dtype="float32", draft=str(draft), enforce_eager=True, compile_draft=True) as llm:
        proposer = llm.engine.proposer
        assert proposer.compiled_decode is None
        assert not hasattr(proposer.draft.before_attention, "compiled")


class SkewedProposer:
    """Samples one draft from a fixed q that is skewed against the target (most mass on the target's
    least likely candidate), so acceptance and the residual resample both matter."""

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, options: dict[int, list[int]], vocab: int):
        self.options, self.vocab = options, vocab

    def propose(self, requests: list[DraftRequest], aux_hidden) -> list[Drafts]:
        out = []
        for r in requests:
            if not r.num_drafts:
                out.append(Drafts([]))
                continue
            q = torch.zeros(self.vocab)
            q[self.options[r.token_ids[-1]]] = torch.tensor([0.1, 0.2, 0.7])  # the newest token is t1
            out.append(Drafts([int(torch.multinomial(q, 1, generator=r.draft_generator(0)))], q[None]))
        return out

    def release(self, request_ids: list[str]) -> None:
        pass


@pytest.mark.parametrize("proposer", ["eagle3", "skewed"])
def test_sampled_speculation_matches_the_target_joint_distribution(target, draft, proposer):
    """End to end: (t1, t2) drawn with drafts follow the target's exact joint p(t1) * p(t2 | t1).
    top_k=3 keeps the joint to 9 cells; t2 is the first token that passes through verification (t1
    is sampled by the prefill step)."""
    prompt = [1, 40, 41, 42, 43]
    # max_tokens 3: after t1 there is room for one draft (drafting for the very last token is pointless).
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(900)]
    joint, options = {}, {}
    with LLM(str(target), dtype="float32") as llm:
        first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0].logprobs[0]
        candidates = sorted(first, key=lambda t: first[t].rank)[:3]
        p1 = torch.softmax(torch.tensor([first[t].logprob for t in candidates]), -1)
        for t1, p in zip(candidates, p1.tolist(), strict=True):
            second = llm.generate([prompt + [t1]], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0]
            options[t1] = sorted(second.logprobs[0], key=lambda t: second.logprobs[0][t].rank)[:3]
            p2 = torch.softmax(torch.tensor([second.logprobs[0][t].logprob for t in options[t1]]), -1)
            joint.update({(t1, t2): p * q for t2, q in zip(options[t1], p2.tolist(), strict=True)})
    with LLM(str(target), dtype="float32", draft=str(draft), compile_draft=False, num_speculative_tokens=2,
             proposer=SkewedProposer(options, vocab=160) if proposer == "skewed" else None) as llm:
        outs = llm.generate([prompt] * len(params), params)
        stats = llm.engine.spec_stats
        assert stats.num_verify_steps == len(params) and 0 < stats.num_accepted_tokens < len(params)
    counts = {cell: 0 for cell in joint}
    for out in outs:
        counts[tuple(out.token_ids[:2])] += 1  # a pair outside the 9 cells would raise KeyError: wrong support
    chi2 = sum((counts[c] - len(params) * joint[c]) ** 2 / (len(params) * joint[c]) for c in joint)
    assert chi2 < 26.12  # the 0.1% point of chi-square with 8 degrees of freedom


def test_adaptive_draft_length_keeps_greedy_output_and_times_the_steps(target, draft, reference):
    """speculative_policy adaptive: the step costs are timed at start-up (target and draft, each batch
    size up to max_num_seqs, each length a step may choose: every one eagerly), every step drafts
    what the model says pays, and greedy output is what it is without drafts. A request that opts out
    never drafts; one that asks for speculation from an engine without a draft is refused."""
    no_drafts = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculation=False)
    with LLM(str(target), dtype="float32", draft=str(draft), num_speculative_tokens=3, compile_draft=False,
             enforce_eager=True, speculative_policy="adaptive", max_num_seqs=4) as llm:
        timed = llm.engine.stats().step_costs
        outs = llm.generate(_prompts(), GREEDY)
        opted_out = llm.generate(_prompts()[:2], no_drafts)
        policy, stats = llm.engine.draft_lengths, llm.engine.stats()
    assert {(step, n, length) for step, n, length, _ in timed} == {
        (step, n, length) for step in ("target", "draft") for n in (1, 2, 4) for length in range(4)} - {
        ("target", n, 0) for n in (1, 2, 4)} | {("target", n, 4) for n in (1, 2, 4)}
    assert all(ms > 0 for *_, ms in timed)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert [o.token_ids for o in opted_out] == [r.token_ids for r in reference[:2]]
    assert all("acceptance_length" not in o.metrics for o in opted_out)
    assert sum(policy.num_chosen.values()) > 0 and len(stats.acceptance_rates) == 3
    assert policy.costs.steps >= policy.num_steps > 0  # every step counts: how stale each figure is
    with LLM(str(target), dtype="float32", enforce_eager=True) as llm, pytest.raises(
            InvalidRequestError, match="speculation is true, but this engine has no draft model"):
        llm.generate(_prompts()[:1], SamplingParams(max_tokens=2, speculation=True))


def test_speculation_policy_and_field_are_checked_at_the_boundary(target):
    with pytest.raises(ValueError, match="speculative_policy must be one of adaptive, fixed, got 'greedy'"):
        LLM(str(target), speculative_policy="greedy")
    with pytest.raises(InvalidRequestError, match="speculation must be true, false or null, got 'yes'"):
        SamplingParams(speculation="yes")
