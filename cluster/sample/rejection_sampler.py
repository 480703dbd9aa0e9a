"""Lossless verification of draft tokens against the target's logits.

Greedy: accept drafts while each equals the target's argmax at its position; then append the
target's own choice (the correction at the first mismatch, or a bonus token after k accepts).
Sampling (Leviathan et al. / Chen et al.): accept draft d with probability min(1, p(d) / q(d)); at the
first rejection sample from normalise(max(0, p - q)); after k accepts sample the bonus from p. The
emitted tokens then follow the target's distribution p exactly, whatever the draft's q.
Coupled (Gumbel-max coupling, `coupled=True`): the draft proposed with the very noise the target
samples each position with (Purpose.SAMPLE); a draft is accepted exactly when it equals the target's
sample there, and the target's sample is emitted at the first mismatch. The emitted tokens are then
the tokens plain sampling draws with the same seed, bit for bit: lossless by construction, and a
seeded request reads the same with or without a draft. Its acceptance is lower than rejection
sampling's (which accepts as often as any lossless scheme can), so it is an option.
"""

from __future__ import annotations

import torch

from warpspec.sample.keyed_random import KeyedRandom, Purpose
from warpspec.sample.sampler import exponential_noise, greedy_tokens, sample_from, sampling_probs
from warpspec.sampling_params import SamplingParams


def verify_batch(target_logits: torch.Tensor, row_starts: list[int], draft_ids: list[list[int]],
                 draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                 randoms: list[KeyedRandom], positions: list[int], coupled: bool = False) -> list[list[int]]:
    """Verify every sequence's drafts at once, with no Python loop over the vocabulary (nor, when any
    request samples, over the drafts).

    Sequence i has k_i = len(draft_ids[i]) drafts and k_i + 1 rows of target_logits [num_rows, vocab]
    from row_starts[i]: the positions of [last token, d1, ..., dk]. draft_probs[i] [k_i, vocab] is the
    q its drafts were sampled from (unused when coupled); None for a greedy request, or drafts a
    deterministic drafter chose (spec_decode/ngram.py): q all on each draft. positions[i] is the
    position of sequence i's first draft. Returns per sequence the 1..k_i + 1 tokens to append: the
    accepted drafts, then the correction or bonus token.

    Every draw is keyed by its request's seed and the position it decides (keyed_random.py, beside this file), so
    seeded requests stay reproducible whatever else is verified beside them and however many drafts
    a step verifies."""
    if all(p.is_greedy for p in params):
        # The common batch: one argmax over every row, the rest in Python. The tensor path below
        # costs ~20 small ops (~0.2 ms of a 2.8 ms speculative step of the bundled pair at batch 1).
        choices = greedy_tokens(target_logits).tolist()
        return [accept_greedy(d, choices[start : start + len(d) + 1])
                for d, start in zip(draft_ids, row_starts, strict=True)]
    num_seqs, device, vocab = len(draft_ids), target_logits.device, target_logits.shape[-1]
    num_drafts = torch.tensor([len(d) for d in draft_ids], device=device)
    k_max = int(num_drafts.max())
    position = torch.arange(k_max + 1, device=device)
    # [num_seqs, k_max + 1] rows of each position; padding repeats the sequence's last row.
    rows = torch.tensor(row_starts, device=device)[:, None] + torch.minimum(position[None, :], num_drafts[:, None])
    is_draft = position[None, :k_max] < num_drafts[:, None]  # [num_seqs, k_max]
    drafts = torch.tensor([d + [0] * (k_max - len(d)) for d in draft_ids], device=device).view(num_seqs, k_max)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    accepted = torch.zeros(num_seqs, dtype=torch.long, device=device)
    final = torch.zeros(num_seqs, dtype=torch.long, device=device)
    if greedy:
        g = torch.tensor(greedy, device=device)
        accepted[g], final[g] = _verify_greedy(target_logits, rows[g], drafts[g], is_draft[g])

    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        s = torch.tensor(sampled, device=device)
        num_s = len(sampled)
        row_params = [params[i] for i in sampled for _ in range(k_max + 1)]
        p = sampling_probs(target_logits[rows[s]].flatten(0, 1), row_params).view(num_s, k_max + 1, vocab)
        verify_sampled = _verify_coupled if coupled else _verify_by_rejection
        accepted[s], final[s] = verify_sampled(p, drafts[s], is_draft[s], [draft_probs[i] for i in sampled],
                                               [randoms[i] for i in sampled], [positions[i] for i in sampled])

    return [d[:a] + [t] for d, a, t in zip(draft_ids, accepted.tolist(), final.tolist(), strict=True)]


def accept_greedy(draft_ids: list[int], choices: list[int]) -> list[int]:
    """The leading run of drafts equal to the target's choices at their positions, then the target's
    choice after that run: drafts [5, 7, 9] against choices [5, 7, 2, 4] -> [5, 7, 2]; all three
    accepted -> [5, 7, 9, 4] (the bonus token)."""
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == choices[accepted]:
        accepted += 1
    return draft_ids[:accepted] + [choices[accepted]]


def _verify_greedy(target_logits: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor,
                   is_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the leading run of drafts equal to the target's argmax, then emit its argmax there.
    rows [num_seqs, k_max + 1] index target_logits; drafts and is_draft [num_seqs, k_max]."""
    k_max = drafts.shape[1]
    choices = greedy_tokens(target_logits[rows])  # [num_seqs, k_max + 1]
    matches = (drafts == choices[:, :k_max]) & is_draft
    # Accepted = the length of the leading run of matches: [1, 1, 0, 1] -> 2.
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    return accepted, choices.gather(1, accepted[:, None])[:, 0]


def _verify_by_rejection(p: torch.Tensor, drafts: torch.Tensor, is_draft: torch.Tensor,
                         draft_probs: list[torch.Tensor | None], randoms: list[KeyedRandom],
                         positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """p [num_seqs, k_max + 1, vocab] target distributions at each sequence's positions; drafts and
    is_draft [num_seqs, k_max]. Returns the number of accepted drafts and the final token, per sequence."""
    num_seqs, k_max, vocab = drafts.shape[0], drafts.shape[1], p.shape[-1]
    device = p.device
    num_drafts = is_draft.sum(dim=-1).tolist()
    # q, zero at padding and at position k_i (after k_i accepts the bonus comes from p alone).
    q = torch.zeros(num_seqs, k_max + 1, vocab, device=device)
    uniforms = torch.ones(num_seqs, k_max, device=device)
    for row, (probs, random, first, k) in enumerate(zip(draft_probs, randoms, positions, num_drafts, strict=True)):
        if not k:
            continue
        if probs is None:  # deterministic drafts: accepted with probability p(d), residual p without d
            q[row, torch.arange(k, device=device), drafts[row, :k]] = 1.0
        else:
            q[row, :k] = probs[:k].to(device)
        uniforms[row, :k] = torch.cat([torch.rand(1, generator=random.generator(first + j, Purpose.ACCEPT))
                                       for j in range(k)]).to(device)
    d = drafts[..., None]
    p_draft, q_draft = p[:, :k_max].gather(2, d)[..., 0], q[:, :k_max].gather(2, d)[..., 0]
    # u < p/q without dividing by a q of 0; never a draft the target gives no mass (a grammar's mask), even at u = 0.
    accepts = (uniforms * q_draft <= p_draft) & (p_draft > 0) & is_draft
    accepted = accepts.long().cumprod(dim=-1).sum(dim=-1)
    # The final token's distribution: normalise(max(0, p - q)) at the first rejection, p after all accepted.
    at = accepted[:, None, None].expand(num_seqs, 1, vocab)
    p_at, q_at = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]
    residual = (p_at - q_at).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    # p == q up to rounding leaves no residual mass: then p itself is the right distribution.
    dist = torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny), p_at)
    # The bonus token after k_i accepts is what plain sampling would draw at its position.
    generators = [random.generator(first + a, Purpose.SAMPLE if a == k else Purpose.RESIDUAL)
                  for random, first, a, k in zip(randoms, positions, accepted.tolist(), num_drafts, strict=True)]
    return accepted, sample_from(dist, generators)


def _verify_coupled(p: torch.Tensor, drafts: torch.Tensor, is_draft: torch.Tensor,
                    draft_probs: list[torch.Tensor | None], randoms: list[KeyedRandom],
                    positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Like greedy verification, against the target's own sample at every position instead of its
    argmax: accept the leading run of drafts equal to it, then emit it."""
    num_seqs, k_max, vocab = drafts.shape[0], drafts.shape[1], p.shape[-1]
    num_drafts = is_draft.sum(dim=-1).tolist()
    # Noise for positions first .. first + k_i; padding rows repeat the last one (never chosen from).
    generators = [random.generator(first + min(j, k), Purpose.SAMPLE)
                  for random, first, k in zip(randoms, positions, num_drafts, strict=True) for j in range(k_max + 1)]
    noise = exponential_noise(generators, vocab).to(p.device).view(num_seqs, k_max + 1, vocab)
    choices = greedy_tokens(p / noise)  # [num_seqs, k_max + 1], sample_from's race row by row
    matches = (drafts == choices[:, :k_max]) & is_draft
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    return accepted, choices.gather(1, accepted[:, None])[:, 0]


def verify(target_logits: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, random: KeyedRandom, position: int, coupled: bool = False) -> list[int]:
    """verify_batch for one sequence: target_logits [k + 1, vocab], draft_probs [k, vocab] or None,
    its first draft at position."""
    return verify_batch(target_logits, [0], [draft_ids], [draft_probs], [params], [random], [position], coupled)[0]
