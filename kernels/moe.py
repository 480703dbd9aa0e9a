"""Llama 4 mixture-of-experts: sigmoid top-k routing and a grouped expert compute that touches only
the experts that received tokens (transformers runs every expert densely).

Expert weights may be FP8 (float8_e4m3fn) with per-output-channel scales, gate_up_scale [E, 2I] and
down_scale [E, H]: W = float(W_fp8) * scale. The references dequantize the experts they use; the
Triton versions (kernels/triton/moe.py, on CUDA tensors) dequantize tile by tile inside the GEMM.
"""

import torch
import torch.nn.functional as F

from warpspec.kernels import batch_invariant
from warpspec.kernels.batch_invariant import float_dtype
from warpspec.kernels.dispatch import use_triton


def route_topk_sigmoid(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (expert_ids [num_tokens, k], scores [num_tokens, k]).

    The sigmoid is taken of the chosen logits only (unchosen experts weigh exactly 0), in float32 and
    cast back, as transformers does."""
    if use_triton(router_logits):
        from warpspec.kernels.triton.moe import route_topk_sigmoid_triton

        return route_topk_sigmoid_triton(router_logits, top_k)
    return route_topk_sigmoid_reference(router_logits, top_k)


def route_topk_sigmoid_reference(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top_logits, expert_ids = torch.topk(router_logits, top_k, dim=-1)
    scores = torch.sigmoid(top_logits.to(float_dtype(top_logits))).to(router_logits.dtype)
    return expert_ids, scores


def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    expert_ids: torch.Tensor,
    scores: torch.Tensor,
    first_expert: int = 0,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts of expert_e(x * score_e). The score scales the INPUT.

    x [num_tokens, hidden]; gate_up_proj [num_local, hidden, 2 * inter] (gate half then up half);
    down_proj [num_local, inter, hidden]; expert_ids/scores [num_tokens, k]. Experts outside
    [first_expert, first_expert + num_local) belong to another rank and contribute nothing here.
    """
    if use_triton(x):
        from warpspec.kernels.triton.moe import moe_experts_triton

        return moe_experts_triton(x, gate_up_proj, down_proj, expert_ids, scores, first_expert,
                                  gate_up_scale, down_scale)
    if torch.compiler.is_compiling():
        # The grouped reference sizes its expert slices from the routing (a host read): a compiled
        # step would break its graph there, in every MoE layer.
        return moe_experts_fixed_shape(x, gate_up_proj, down_proj, expert_ids, scores, first_expert,
                                       gate_up_scale, down_scale)
    return moe_experts_reference(x, gate_up_proj, down_proj, expert_ids, scores, first_expert,
                                 gate_up_scale, down_scale)


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One expert's [in, out] weight in dtype; FP8 weights times their per-output-channel scale [out]."""
    if scale is None:
        return weight
    return (weight.float() * scale.float()[None, :]).to(dtype)


def expert_ffn(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU on its tokens x [n, hidden]: w_gate_up [hidden, 2 * inter], w_down [inter,
    hidden]. In deterministic mode each GEMM runs in float64 and rounds to x's dtype, as a bf16 GEMM
    rounds its output."""
    if not batch_invariant.is_enabled():
        gate, up = (x @ w_gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w_down
    gate, up = (x.double() @ w_gate_up.double()).to(x.dtype).chunk(2, dim=-1)
    return (batch_invariant.silu_mul(gate, up).double() @ w_down.double()).to(x.dtype)


def moe_experts_reference(x, gate_up_proj, down_proj, expert_ids, scores, first_expert=0,
                          gate_up_scale=None, down_scale=None) -> torch.Tensor:
    num_local = gate_up_proj.shape[0]
    flat_ids = expert_ids.reshape(-1) - first_expert
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(expert_ids.shape[1])
    # Sort the (token, expert) assignments by local expert, other ranks' experts last, so that each
    # expert reads one contiguous slice: ids [2, 0, 2] -> order [1, 0, 2], counts [1, 0, 2].
    is_local = (flat_ids >= 0) & (flat_ids < num_local)
    order = torch.argsort(torch.where(is_local, flat_ids, num_local), stable=True)
    counts = torch.bincount(flat_ids[is_local], minlength=num_local).tolist()
    order = order[: sum(counts)]
    tokens = token_of[order]
    expert_in = x[tokens] * scores.reshape(-1)[order, None]
    # Deterministic mode reads float64 copies, made once per parameter (FP8 experts dequantize per call).
    use_copies = batch_invariant.is_enabled() and gate_up_scale is None
    gate_up_weights = batch_invariant.float64_copy(gate_up_proj) if use_copies else gate_up_proj
    down_weights = batch_invariant.float64_copy(down_proj) if use_copies else down_proj
    outputs = []
    for expert, chunk in enumerate(expert_in.split(counts)):
        if chunk.shape[0]:
            w_gate_up = dequantize_expert(gate_up_weights[expert], None if gate_up_scale is None
                                          else gate_up_scale[expert], x.dtype)
            w_down = dequantize_expert(down_weights[expert], None if down_scale is None else down_scale[expert],
                                       x.dtype)
            outputs.append(expert_ffn(chunk, w_gate_up, w_down))
    out = torch.zeros_like(x)
    if outputs:
        out.index_add_(0, tokens, torch.cat(outputs).to(x.dtype))  # bf16 under autocast in training
    return out


def moe_experts_fixed_shape(x, gate_up_proj, down_proj, expert_ids, scores, first_expert=0,
                            gate_up_scale=None, down_scale=None) -> torch.Tensor:
    """The same sum with every shape fixed by the token count, for compiled steps: each (token,
    choice) pair reads its expert's weights by index, with no host read of the routing. An expert of
    another rank gets score 0, and SwiGLU without biases maps a zero input to an exact zero.

    expert_ids [[2], [0]] on a rank holding experts 0..3: token 0 runs gate_up_proj[2], token 1
    gate_up_proj[0]; each [1, hidden] @ [hidden, 2 * inter]."""
    num_local = gate_up_proj.shape[0]
    local_ids = expert_ids - first_expert
    is_local = (local_ids >= 0) & (local_ids < num_local)
    local_ids = local_ids.clamp(0, num_local - 1)
    expert_in = x[:, None, :] * torch.where(is_local, scores, 0)[..., None]  # [num_tokens, k, hidden]
    w_gate_up, w_down = gate_up_proj[local_ids], down_proj[local_ids]  # [num_tokens, k, in, out]
    if gate_up_scale is not None:
        w_gate_up = (w_gate_up.float() * gate_up_scale[local_ids].float()[..., None, :]).to(x.dtype)
    if down_scale is not None:
        w_down = (w_down.float() * down_scale[local_ids].float()[..., None, :]).to(x.dtype)
    gate, up = (expert_in[..., None, :] @ w_gate_up).chunk(2, dim=-1)
    out = (F.silu(gate) * up) @ w_down  # [num_tokens, k, 1, hidden]
    return out[:, :, 0].sum(dim=1)
