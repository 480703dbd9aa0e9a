"""verify_batch against the textbook one-sequence loop: the same tokens, draw for draw, over ragged
batches that mix greedy and sampled requests (losslessness itself is tested in test_speculative.py)."""

from __future__ import annotations

import torch

from warpspec.rejection_sampler import verify_batch
from warpspec.sampler import sample_from, sampling_probs
from warpspec.sampling_params import SamplingParams


def verify_one(logits, draft_ids, draft_probs, params, generator) -> list[int]:
    """Leviathan et al.'s loop for one sequence, with the draws in verify_batch's order."""
    k = len(draft_ids)
    if params.is_greedy:
        choices = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and draft_ids[accepted] == choices[accepted]:
            accepted += 1
        return draft_ids[:accepted] + [choices[accepted]]
    p = sampling_probs(logits, [params] * (k + 1))
    uniforms = torch.rand(k, generator=generator)
    for i, draft in enumerate(draft_ids):
        if uniforms[i] * draft_probs[i, draft] > p[i, draft]:
            residual = (p[i] - draft_probs[i]).clamp(min=0)
            row = residual / residual.sum() if residual.sum() > 0 else p[i]
            return draft_ids[:i] + [int(sample_from(row[None], [generator])[0])]
    return draft_ids + [int(sample_from(p[k][None], [generator])[0])]


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
        batched_generators = [torch.Generator().manual_seed(1000 * trial + i) for i in range(num_seqs)]
        single_generators = [torch.Generator().manual_seed(1000 * trial + i) for i in range(num_seqs)]
        got = verify_batch(torch.cat(logits), row_starts, draft_ids, probs, params, batched_generators)
        expected = [verify_one(r, d, q, p, g)
                    for r, d, q, p, g in zip(logits, draft_ids, probs, params, single_generators, strict=True)]
        assert got == expected, trial
        # And every generator is left where the loop left it: the next draws agree too.
        assert all(torch.equal(a.get_state(), b.get_state())
                   for a, b in zip(batched_generators, single_generators, strict=True))
