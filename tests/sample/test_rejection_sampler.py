"""verify_batch against the textbook one-sequence loop: the same tokens, draw for draw, over ragged
batches that mix greedy and sampled requests; coupled verification against plain sampling
(losslessness itself is tested in test_speculative.py)."""

from __future__ import annotations

import torch

from warpspec.sample.keyed_random import KeyedRandom, Purpose
from warpspec.sample.rejection_sampler import verify, verify_batch
from warpspec.sample.sampler import sample, sample_from, sampling_probs
from warpspec.sampling_params import SamplingParams


def verify_one(logits, draft_ids, draft_probs, params, random, first) -> list[int]:
    """Leviathan et al.'s loop for one sequence, its first draft at position `first`, with
    verify_batch's keyed draws: a uniform per draft, then the correction or the bonus token."""
    k = len(draft_ids)
    if params.is_greedy:
        choices = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and draft_ids[accepted] == choices[accepted]:
            accepted += 1
        return draft_ids[:accepted] + [choices[accepted]]
    p = sampling_probs(logits, [params] * (k + 1))
    for i, draft in enumerate(draft_ids):
        uniform = torch.rand(1, generator=random.generator(first + i, Purpose.ACCEPT))
        if uniform * draft_probs[i, draft] > p[i, draft]:
            residual = (p[i] - draft_probs[i]).clamp(min=0)
            row = residual / residual.sum() if residual.sum() > 0 else p[i]
            return draft_ids[:i] + [int(sample_from(row[None], [random.generator(first + i, Purpose.RESIDUAL)])[0])]
    return draft_ids + [int(sample_from(p[k][None], [random.generator(first + k, Purpose.SAMPLE)])[0])]


def test_batched_verification_matches_one_sequence_at_a_time():
    vocab, rng = 12, torch.Generator().manual_seed(0)
    for trial in range(200):
        num_seqs = int(torch.randint(1, 6, (1,), generator=rng))
        draft_ids, probs, params, logits, row_starts = [], [], [], [], []
        for i in range(num_seqs):
            k = int(torch.randint(1, 5, (1,), generator=rng))
            sampled = bool(torch.rand(1, generator=rng) < 0.6)
            rows = torch.randn(k + 1, vocab, generator=rng) * 2
            q = torch.softmax(torch.randn(k, vocab, generator=rng), -1) if sampled else None
            if sampled:
                drafts = [int(torch.multinomial(q[j], 1, generator=rng)) for j in range(k)]
            else:  # mostly the argmax, so that runs of accepts happen
                drafts = [int(r.argmax()) if torch.rand(1, generator=rng) < 0.7 else (int(r.argmax()) + 1) % vocab
                          for r in rows[:k]]
            params.append(SamplingParams(temperature=0.9, top_k=8 if i % 2 else 0, seed=i) if sampled
                          else SamplingParams(temperature=0.0))
            row_starts.append(sum(len(r) for r in logits))
            logits.append(rows)
            draft_ids.append(drafts)
            probs.append(q)
        randoms = [KeyedRandom(1000 * trial + i) for i in range(num_seqs)]
        firsts = [int(torch.randint(1, 500, (1,), generator=rng)) for _ in range(num_seqs)]
        got = verify_batch(torch.cat(logits), row_starts, draft_ids, probs, params, randoms, firsts)
        expected = [verify_one(*one) for one in zip(logits, draft_ids, probs, params, randoms, firsts, strict=True)]
        assert got == expected, trial


def test_draws_are_keyed_by_position_not_by_what_came_before():
    """The same request verifying the same rows decides the same way at the same position, and
    differently at others: nothing is consumed between calls."""
    vocab, k = 50, 3
    logits = torch.zeros(k + 1, vocab)  # p uniform, so the draws alone decide
    q = torch.full((k, vocab), 1 / vocab)
    params, random = SamplingParams(temperature=1.0), KeyedRandom(7)
    draft_ids = [3, 4, 5]
    at_40 = verify(logits, draft_ids, q, params, random, 40)
    assert all(verify(logits, draft_ids, q, params, random, 40) == at_40 for _ in range(3))
    finals = {tuple(verify(logits, [], None, params, random, position)) for position in range(40, 60)}
    assert len(finals) > 10  # 20 positions, 50 equally likely tokens each


def test_coupled_verification_emits_what_plain_sampling_draws():
    """Under coupling every emitted token is sample()'s token at its position with the same seed:
    the accepted drafts, then the target's own sample at the first mismatch (or after the last draft)."""
    vocab, rng = 30, torch.Generator().manual_seed(1)
    num_accepted = []
    for trial in range(100):
        k = int(torch.randint(1, 5, (1,), generator=rng))
        logits = torch.randn(k + 1, vocab, generator=rng) * 2
        params, random, first = SamplingParams(temperature=0.8, top_p=0.9), KeyedRandom(trial), 10 + trial
        plain = sample(logits, [params] * (k + 1), [random] * (k + 1), list(range(first, first + k + 1))).tolist()
        # Drafts that agree with the target's samples for a while, then (sometimes) stray.
        stray = int(torch.randint(0, k + 1, (1,), generator=rng))
        drafts = [t if j < stray else (t + 1) % vocab for j, t in enumerate(plain[:k])]
        tokens = verify(logits, drafts, None, params, random, first, coupled=True)
        assert tokens == plain[: len(tokens)], trial
        assert len(tokens) == min(stray, k) + 1, trial
        num_accepted.append(len(tokens) - 1)
    assert 0 < sum(num_accepted) < 4 * len(num_accepted)
