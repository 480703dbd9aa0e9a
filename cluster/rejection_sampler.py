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


def verify_batch(target_logits: torch.Tensor, row_starts: list[int], draft_ids: list[list[int]],
                 draft_probs: list[torch.Tensor | None], params: list[SamplingParams],
                 generators: list[torch.Generator]) -> list[list[int]]:
    """Verify every sequence's drafts at once, with no Python loop over the vocabulary or the drafts.

    Sequence i has k_i = len(draft_ids[i]) drafts and k_i + 1 rows of target_logits [num_rows, vocab]
    from row_starts[i]: the positions of [last token, d1, ..., dk]. draft_probs[i] [k_i, vocab] is the
    q its drafts were sampled from (None for greedy). Returns per sequence the 1..k_i + 1 tokens to
    append: the accepted drafts, then the correction or bonus token.

    Each sampled sequence draws k_i uniforms, then one token, from its own generator, so seeded
    requests stay reproducible whatever else is verified beside them."""
    num_seqs, device, vocab = len(draft_ids), target_logits.device, target_logits.shape[-1]
    num_drafts = torch.tensor([len(d) for d in draft_ids], device=device)
    k_max = int(num_drafts.max())
    position = torch.arange(k_max + 1, device=device)
    # [num_seqs, k_max + 1] rows of each position; padding repeats the sequence's last row.
    rows = torch.tensor(row_starts, device=device)[:, None] + torch.minimum(position[None, :], num_drafts[:, None])
    is_draft = position[None, :k_max] < num_drafts[:, None]  # [num_seqs, k_max]
    drafts = torch.tensor([d + [0] * (k_max - len(d)) for d in draft_ids], device=device).view(num_seqs, k_max)
    accepted = torch.zeros(num_seqs, dtype=torch.long, device=device)
    final = torch.zeros(num_seqs, dtype=torch.long, device=device)

    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy:
        g = torch.tensor(greedy, device=device)
        choices = target_logits[rows[g]].argmax(dim=-1)  # [num_greedy, k_max + 1]
        matches = (drafts[g] == choices[:, :k_max]) & is_draft[g]
        # Accepted = the length of the leading run of matches: [1, 1, 0, 1] -> 2.
        accepted[g] = matches.long().cumprod(dim=-1).sum(dim=-1)
        final[g] = choices.gather(1, accepted[g][:, None])[:, 0]

    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        s = torch.tensor(sampled, device=device)
        num_s = len(sampled)
        row_params = [params[i] for i in sampled for _ in range(k_max + 1)]
        p = sampling_probs(target_logits[rows[s]].flatten(0, 1), row_params).view(num_s, k_max + 1, vocab)
        # q, zero at padding and at position k_i (after k_i accepts the bonus comes from p alone).
        q = torch.zeros(num_s, k_max + 1, vocab, device=device)
        for row, i in enumerate(sampled):
            q[row, : len(draft_ids[i])] = draft_probs[i][: len(draft_ids[i])].to(device)
        uniforms = torch.ones(num_s, k_max, device=device)
        for row, i in enumerate(sampled):
            uniforms[row, : len(draft_ids[i])] = torch.rand(len(draft_ids[i]), generator=generators[i]).to(device)
        d = drafts[s][..., None]
        p_draft, q_draft = p[:, :k_max].gather(2, d)[..., 0], q[:, :k_max].gather(2, d)[..., 0]
        accepts = (uniforms * q_draft <= p_draft) & is_draft[s]  # u < p/q without dividing by a q of 0
        accepted[s] = accepts.long().cumprod(dim=-1).sum(dim=-1)
        # The final token's distribution: normalise(max(0, p - q)) at the first rejection, p after all accepted.
        at = accepted[s][:, None, None].expand(num_s, 1, vocab)
        p_at, q_at = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]
        residual = (p_at - q_at).clamp(min=0)
        total = residual.sum(dim=-1, keepdim=True)
        # p == q up to rounding leaves no residual mass: then p itself is the right distribution.
        dist = torch.where(total > 0, residual / total.clamp(min=torch.finfo(residual.dtype).tiny), p_at)
        final[s] = sample_from(dist, [generators[i] for i in sampled])

    return [d[:a] + [t] for d, a, t in zip(draft_ids, accepted.tolist(), final.tolist(), strict=True)]


def verify(target_logits: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator) -> list[int]:
    """verify_batch for one sequence: target_logits [k + 1, vocab], draft_probs [k, vocab] or None."""
    return verify_batch(target_logits, [0], [draft_ids], [draft_probs], [params], [generator])[0]
