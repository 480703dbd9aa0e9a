"""Llama 4 mixture-of-experts reference: sigmoid top-k routing and a gather-by-expert compute that
touches only the experts that received tokens (transformers runs every expert densely)."""

import torch
import torch.nn.functional as F


def route_topk_sigmoid(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (expert_ids [num_tokens, k], scores [num_tokens, k]).

    The sigmoid is taken of the chosen logits only (unchosen experts weigh exactly 0), in float32 and
    cast back, as transformers does."""
    top_logits, expert_ids = torch.topk(router_logits, top_k, dim=-1)
    scores = torch.sigmoid(top_logits.float()).to(router_logits.dtype)
    return expert_ids, scores


def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """Sum over each token's chosen experts of expert_e(x * score_e). The score scales the INPUT.

    x [num_tokens, hidden]; gate_up_proj [num_local, hidden, 2 * inter] (gate half then up half);
    down_proj [num_local, inter, hidden]; expert_ids/scores [num_tokens, k]. Experts outside
    [first_expert, first_expert + num_local) belong to another rank and contribute nothing here.
    """
    num_local = gate_up_proj.shape[0]
    out = torch.zeros_like(x)
    flat_ids = expert_ids.reshape(-1) - first_expert
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(expert_ids.shape[1])
    flat_scores = scores.reshape(-1)
    # Sort assignments by local expert so each expert sees one contiguous slice of tokens.
    is_local = (flat_ids >= 0) & (flat_ids < num_local)
    order = torch.argsort(torch.where(is_local, flat_ids, num_local), stable=True)
    counts = torch.bincount(flat_ids[is_local], minlength=num_local).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = order[start : start + count]
        start += count
        tokens = token_of[idx]
        expert_in = x[tokens] * flat_scores[idx, None]
        gate, up = (expert_in @ gate_up_proj[expert]).chunk(2, dim=-1)
        out.index_add_(0, tokens, (F.silu(gate) * up) @ down_proj[expert])
    return out
