"""The gathered MoE against transformers' formulation: every expert run densely on inputs scaled by
a score that is 0 for the experts a token did not choose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from warpspec.kernels.moe import moe_experts, route_topk_sigmoid


def dense_reference(x, gate_up, down, router_logits, top_k):
    top_values, top_ids = router_logits.topk(top_k, dim=-1)
    scores = torch.full_like(router_logits, float("-inf")).scatter(1, top_ids, top_values).sigmoid()
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        gate, up = (x * scores[:, e : e + 1] @ gate_up[e]).chunk(2, dim=-1)
        out += (F.silu(gate) * up) @ down[e]
    return out


@pytest.mark.parametrize("top_k", [1, 2])
def test_gathered_moe_matches_dense(top_k):
    gen = torch.Generator().manual_seed(top_k)
    num_tokens, hidden, inter, num_experts = 13, 16, 8, 6
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, hidden, 2 * inter, generator=gen)
    down = torch.randn(num_experts, inter, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    expert_ids, scores = route_topk_sigmoid(logits, top_k)
    assert expert_ids.shape == scores.shape == (num_tokens, top_k)
    torch.testing.assert_close(moe_experts(x, gate_up, down, expert_ids, scores),
                               dense_reference(x, gate_up, down, logits, top_k), atol=1e-4, rtol=1e-4)


def test_expert_ranks_sum_to_the_whole():
    """Experts split across ranks ([0, 3) and [3, 6)): the partial outputs add up to the full MoE."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 16, generator=gen)
    gate_up = torch.randn(6, 16, 16, generator=gen)
    down = torch.randn(6, 8, 16, generator=gen)
    expert_ids, scores = route_topk_sigmoid(torch.randn(9, 6, generator=gen), 2)
    whole = moe_experts(x, gate_up, down, expert_ids, scores)
    parts = (moe_experts(x, gate_up[:3], down[:3], expert_ids, scores, first_expert=0)
             + moe_experts(x, gate_up[3:], down[3:], expert_ids, scores, first_expert=3))
    torch.testing.assert_close(parts, whole, atol=1e-4, rtol=1e-4)


def width_slice(gate_up: torch.Tensor, down: torch.Tensor, rank: int, world_size: int):
    """Rank's slice of every expert under moe_parallel="tensor": gate and up columns side by side,
    the same rows of down. inter 8 over 2 ranks: rank 1 gets gate cols 4..7, up cols 12..15, down rows 4..7."""
    inter = down.shape[1]
    local = inter // world_size
    cols = torch.cat([torch.arange(rank * local, (rank + 1) * local),
                      inter + torch.arange(rank * local, (rank + 1) * local)])
    return gate_up[:, :, cols], down[:, rank * local : (rank + 1) * local]


@pytest.mark.parametrize("world_size", [2, 4])
def test_width_slices_sum_to_the_whole(world_size):
    """Every expert split by width across ranks: SwiGLU is elementwise over the intermediate width,
    so each rank's partial output over its slice adds up to the full MoE."""
    gen = torch.Generator().manual_seed(world_size)
    x = torch.randn(9, 16, generator=gen)
    gate_up = torch.randn(5, 16, 16, generator=gen)
    down = torch.randn(5, 8, 16, generator=gen)
    expert_ids, scores = route_topk_sigmoid(torch.randn(9, 5, generator=gen), 2)
    whole = moe_experts(x, gate_up, down, expert_ids, scores)
    parts = sum(moe_experts(x, *width_slice(gate_up, down, rank, world_size), expert_ids, scores)
                for rank in range(world_size))
    torch.testing.assert_close(parts, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("top_k,first_expert", [(1, 0), (2, 0), (2, 3)])
def test_fixed_shape_experts_compute_the_grouped_reference(top_k, first_expert):
    """The compiled steps' MoE (weights read by index) against the grouped one; first_expert 3: this
    rank holds experts 3..5 of 8, so the others contribute nothing."""
    from warpspec.kernels.moe import moe_experts_fixed_shape, moe_experts_reference

    gen = torch.Generator().manual_seed(1)
    num_local, hidden, inter = 3 if first_expert else 8, 16, 12
    x = torch.randn(7, hidden, generator=gen)
    gate_up = torch.randn(num_local, hidden, 2 * inter, generator=gen) * 0.2
    down = torch.randn(num_local, inter, hidden, generator=gen) * 0.2
    expert_ids, scores = route_topk_sigmoid(torch.randn(7, 8, generator=gen), top_k)
    want = moe_experts_reference(x, gate_up, down, expert_ids, scores, first_expert)
    got = moe_experts_fixed_shape(x, gate_up, down, expert_ids, scores, first_expert)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().sum() > 0
