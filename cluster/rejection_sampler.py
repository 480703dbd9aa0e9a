"""Lossless verification of draft tokens against the target's logits.

Greedy: accept drafts while each equals the target's argmax at its position; then append the
target's own choice (the correction at the first mismatch, or a bonus token after k accepts).
Sampling (Leviathan et al. / Chen et al.): accept draft d with probability min(1, p(d) / q(d)); at the
first rejection sample from normalise(max(0, p - q)); after k accepts sample the bonus from p. The
emitted tokens then follow the target's distribution p exactly, whatever the draft's q.
"""

from __future__ import annotations

import torch

from warpspec.sampler import sample_from, sampling_probs
from warpspec.sampling_params import SamplingParams


def verify(target_logits: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator) -> list[int]:
    """target_logits [k + 1, vocab] at the positions of [last token, d1, ..., dk]; draft_probs
    [k, vocab] (the q each draft was sampled from; None for greedy). Returns the 1..k+1 tokens to
    append: accepted drafts, then the correction or bonus token."""
    k = len(draft_ids)
    if params.is_greedy:
        choices = target_logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and draft_ids[accepted] == choices[accepted]:
            accepted += 1
        return draft_ids[:accepted] + [choices[accepted]]
    p = sampling_probs(target_logits, [params] * (k + 1))
    uniforms = torch.rand(k, generator=generator)
    for i, draft in enumerate(draft_ids):
        q = draft_probs[i, draft]
        if uniforms[i] * q <= p[i, draft]:  # u < p/q without dividing by a q of 0
            continue
        residual = (p[i] - draft_probs[i]).clamp(min=0)
        total = residual.sum()
        # p == q up to rounding leaves no residual mass: then p itself is the right distribution.
        row = residual / total if total > 0 else p[i]
        return draft_ids[:i] + [int(sample_from(row[None], [generator])[0])]
    return draft_ids + [int(sample_from(p[k][None], [generator])[0])]
