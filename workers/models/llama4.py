"""Llama 4 text (transformers' Llama4ForCausalLM and the text model of Llama4ForConditionalGeneration):
its config, its decoder layers and how its checkpoints lay out tensors.

Layers alternate RoPE attention within chunks (with an L2 QK-norm) and NoPE attention over the whole
context (with temperature tuning); feed-forwards are a mixture of experts (sigmoid top-k routing
plus an always-on shared expert) on moe_layers and a dense SwiGLU elsewhere. Routed experts split
over ranks by width (moe_parallel="tensor") or whole (moe_parallel="expert"). The causal LM around
the layers is decoder.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from warpspec.kernels import PagedAttentionMetadata, moe_experts, route_topk_sigmoid
from warpspec.workers.distributed.comm import Communicator
from warpspec.workers.errors import CheckpointError
from warpspec.workers.layers import (
    CheckpointTensor,
    Linear,
    RMSNorm,
    check_shape,
    empty_param,
    even_split,
    load_experts,
)
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.decoder import Attention, DecoderForCausalLM, GatedMLP
from warpspec.workers.step import StepInput

ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
MODEL_TYPES = ("llama4_text", "llama4")  # a config.json that names no architecture


@dataclass(kw_only=True)
class Llama4Config(ModelConfig):
    intermediate_size: int  # each expert's (routed and shared)
    intermediate_size_mlp: int  # the dense layers'
    num_local_experts: int
    num_experts_per_tok: int
    moe_layers: list[int]
    no_rope_layers: list[int]  # transformers' naming is inverted: 1 means the layer DOES use RoPE
    use_qk_norm: bool
    attn_temperature_tuning: bool
    floor_scale: float
    attn_scale: float

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("intermediate_size", "intermediate_size_mlp", "num_local_experts"))
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise CheckpointError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_local_experts ({self.num_local_experts})"
            )
        if len(self.no_rope_layers) < self.num_hidden_layers:
            raise CheckpointError(
                f"no_rope_layers has {len(self.no_rope_layers)} entries, fewer than "
                f"num_hidden_layers ({self.num_hidden_layers})"
            )
        chunk = self.attention_chunk_size
        chunked = [i for i in range(self.num_hidden_layers) if self.uses_rope(i)]
        if chunked and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            # transformers reads a missing key as 8192 (from_dict does too); null or 0 is no chunk at all.
            raise CheckpointError(f"config.json: attention_chunk_size must be a positive integer when layers "
                                  f"use chunked attention (no_rope_layers marks layers {chunked[:8]}"
                                  f"{' ...' if len(chunked) > 8 else ''}), got {chunk!r}")
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise CheckpointError(f"moe_layers {bad} outside 0..{self.num_hidden_layers - 1}")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layers

    def uses_rope(self, layer_id: int) -> bool:
        return bool(self.no_rope_layers[layer_id])

    def chunk_size(self, layer_id: int) -> int | None:
        """Local-attention chunk for RoPE layers; None (full causal) for NoPE layers."""
        return self.attention_chunk_size if self.uses_rope(layer_id) else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Llama4Config:
        """From config.json; the multimodal checkpoint's text model sits under text_config. Defaults
        follow transformers' Llama4TextConfig."""
        architectures = raw.get("architectures") or []
        is_multimodal = "text_config" in raw or "Llama4ForConditionalGeneration" in architectures
        text = raw.get("text_config", raw) if is_multimodal else raw
        if not isinstance(text, dict):
            raise CheckpointError("config.json: text_config must be an object")
        common = ModelConfig.common_fields(text, raw)
        num_layers = common["num_hidden_layers"]
        interval = int(text.get("no_rope_layer_interval", 4))
        no_rope_layers = text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
        step = int(text.get("interleave_moe_layer_step", 1))
        moe_layers = text.get("moe_layers")
        if moe_layers is None:
            moe_layers = list(range(step - 1, num_layers, step))
        return cls(
            **common,
            architecture="Llama4ForConditionalGeneration" if is_multimodal else "Llama4ForCausalLM",
            intermediate_size=int(text.get("intermediate_size", 8192)),
            intermediate_size_mlp=int(text.get("intermediate_size_mlp", 16384)),
            num_local_experts=int(text.get("num_local_experts", 16)),
            num_experts_per_tok=int(text.get("num_experts_per_tok", 1)),
            moe_layers=[int(i) for i in moe_layers],
            no_rope_layers=[int(x) for x in no_rope_layers],
            attention_chunk_size=text.get("attention_chunk_size", 8192),
            use_qk_norm=bool(text.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(text.get("attn_temperature_tuning", True)),
            floor_scale=float(text.get("floor_scale", 8192)),
            attn_scale=float(text.get("attn_scale", 0.1)),
            tensor_prefix="language_model." if is_multimodal else "",
        )


class Llama4Experts(nn.Module):
    """Routed experts in the checkpoint's fused layout, gate_up_proj [E, H, 2I] and down_proj [E, I, H].
    FP8 experts (workers/quantization.py) add per-output-channel scales gate_up_proj_scale [E, 2I]
    and down_proj_scale [E, H] (fbgemm checkpoints store them as [E, 1, 2I] and [E, H, 1]).

    moe_parallel="tensor": every rank holds every expert's slice of the intermediate width, as the
    shared expert is split: gate and up columns [r * I/N, (r + 1) * I/N) side by side, and the same
    rows of down_proj. Each rank reads 1/N of every chosen expert and returns a partial sum that the
    layer's all-reduce completes. moe_parallel="expert": this rank holds whole experts [first_expert,
    end_expert) (6 over 4 ranks: 2, 2, 1, 1); the rank owning a chosen expert reads all of it."""

    quantizable_weights = ("gate_up_proj", "down_proj")  # what FP8 quantization converts (quantization.py)

    def __init__(self, config: Llama4Config, comm: Communicator, dtype: torch.dtype, moe_parallel: str = "tensor"):
        super().__init__()
        self.num_experts, hidden, self.inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.is_tensor_parallel = moe_parallel == "tensor"
        if self.is_tensor_parallel:
            self.first_expert, self.end_expert = 0, self.num_experts
            local_inter = self.inter // comm.world_size
            self.inter_cols = (comm.rank * local_inter, (comm.rank + 1) * local_inter)
        else:
            self.first_expert, self.end_expert = even_split(self.num_experts, comm.world_size, comm.rank)
            local_inter = self.inter
            self.inter_cols = (0, self.inter)
        num_local = self.end_expert - self.first_expert
        self.gate_up_proj = empty_param(num_local, hidden, 2 * local_inter, dtype=dtype)
        self.down_proj = empty_param(num_local, local_inter, hidden, dtype=dtype)
        self.gate_up_proj.weight_loader = self.down_proj.weight_loader = self.weight_loader
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None

    def lay_out_inputs_contiguous(self) -> None:
        """Before the weights load: re-allocate each expert's weights (uninitialised) with the input
        dimension contiguous, [E, out, in] in memory, the shapes unchanged (gate_up_proj still
        [E, H, 2I]); the loader then writes them in that layout (layers.load_experts), with no second
        copy. A CPU's compiled step reads each token's expert by index (kernels/moe.py,
        moe_experts_fixed_shape), and inductor computes its [1, in] @ [in, out] as a sum over `in`:
        contiguous, that sum vectorizes. The bundled target's expert shapes, compiled, 2 threads:
        1 / 4 / 8 / 32 tokens in 49 / 72 / 99 / 196 us against 56 / 114 / 186 / 412
        (benchmarks/results/2026-12-02-expert-layout-cpu.md). Eager GEMMs take the transposed operand
        as it is."""
        for param in (self.gate_up_proj, self.down_proj):
            num_local, num_in, num_out = param.shape
            param.data = torch.empty(num_local, num_out, num_in, dtype=param.dtype,
                                     device=param.device).transpose(1, 2)

    def _gate_up_cols(self) -> tuple[slice, slice]:
        """This rank's gate columns and up columns of a [.., 2I] gate_up tensor."""
        start, end = self.inter_cols
        return slice(start, end), slice(self.inter + start, self.inter + end)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        is_gate_up = param is self.gate_up_proj
        full = (self.num_experts, param.shape[1], 2 * self.inter) if is_gate_up else \
            (self.num_experts, self.inter, param.shape[2])
        check_shape(name, full, loaded.shape)
        scale = self.gate_up_proj_scale if is_gate_up else self.down_proj_scale
        if not self.is_tensor_parallel:
            load_experts(param, loaded, name, self.first_expert, scale)
        elif is_gate_up:  # [gate cols | up cols] of this rank, side by side
            local = param.shape[2] // 2
            for cols, into in zip(self._gate_up_cols(), (slice(0, local), slice(local, 2 * local)), strict=True):
                load_experts(param, loaded, name, 0, scale, cols=cols, into=into)
        else:  # this rank's rows; quantized online, its scales are the amax of its own rows
            load_experts(param, loaded, name, 0, scale, rows=slice(*self.inter_cols))

    def scale_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        """An FP8 checkpoint's per-output-channel scales: the gate/up ones slice with their columns;
        down_proj's, over whole rows, apply to any slice of them as they are."""
        is_gate_up = param is self.gate_up_proj_scale
        num_out = 2 * self.inter if is_gate_up else param.shape[1]
        if loaded.shape not in ((self.num_experts, 1, num_out), (self.num_experts, num_out, 1),
                                (self.num_experts, num_out)):
            check_shape(name, (self.num_experts, num_out), loaded.shape)
        scales = loaded.read(slice(self.first_expert, self.end_expert)).reshape(-1, num_out)
        if is_gate_up and self.is_tensor_parallel:
            gate, up = self._gate_up_cols()
            scales = torch.cat([scales[:, gate], scales[:, up]], dim=-1)
        param.data.copy_(scales)


class Llama4MoE(nn.Module):
    """Router replicated on every rank; each rank runs its part of the routed experts (its slices of
    each, or its whole experts) on the tokens routed to them and its slice of the shared expert. The
    sum of the two partials over ranks is the MoE output."""

    def __init__(self, config: Llama4Config, comm: Communicator, dtype: torch.dtype, moe_parallel: str = "tensor"):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Linear(config.hidden_size, config.num_local_experts, dtype)
        self.experts = Llama4Experts(config, comm, dtype, moe_parallel)
        self.shared_expert = GatedMLP(config.hidden_size, config.intermediate_size, comm, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, scores = route_topk_sigmoid(self.router(x), self.top_k)
        routed = moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, expert_ids, scores,
                             first_expert=self.experts.first_expert, gate_up_scale=self.experts.gate_up_proj_scale,
                             down_scale=self.experts.down_proj_scale)
        return self.shared_expert(x) + routed


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config: Llama4Config, layer_id: int, comm: Communicator, dtype: torch.dtype,
                 moe_parallel: str = "tensor"):
        super().__init__()
        self.self_attn = Attention(config, comm, dtype, uses_rope=config.uses_rope(layer_id),
                                   uses_qk_norm=config.use_qk_norm,
                                   temperature_tuning=(config.floor_scale, config.attn_scale)
                                   if config.attn_temperature_tuning else None,
                                   chunk_size=config.chunk_size(layer_id))
        if config.is_moe_layer(layer_id):
            self.feed_forward: nn.Module = Llama4MoE(config, comm, dtype, moe_parallel)
        else:
            self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size_mlp, comm, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)

    def forward(self, positions: torch.Tensor, normed: torch.Tensor, residual: torch.Tensor, step: StepInput,
                freqs_cis: torch.Tensor, attn_metas: list[PagedAttentionMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
        """normed: input_layernorm's output (the model applies it, fused with the previous layer's
        reduction); returns the feed-forward's partial output and the residual stream after attention."""
        hidden = self.self_attn(positions, normed, step, freqs_cis, attn_metas)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class Llama4ForCausalLM(DecoderForCausalLM):
    config_class = Llama4Config

    def __init__(self, config: Llama4Config, dtype: torch.dtype, comm: Communicator | None = None,
                 moe_parallel: str = "tensor"):
        super().__init__(config, dtype, comm,
                         lambda layer_id: Llama4DecoderLayer(config, layer_id, self.comm, dtype, moe_parallel))

    @classmethod
    def sharded_widths(cls, config: Llama4Config) -> dict[str, int]:
        widths = {}
        if config.moe_layers:  # the shared expert's width, and with moe_parallel="tensor" every routed expert's
            widths["intermediate_size"] = config.intermediate_size
        if len(config.moe_layers) < config.num_hidden_layers:
            widths["intermediate_size_mlp"] = config.intermediate_size_mlp
        return widths

    @classmethod
    def check_parallel_layout(cls, config: Llama4Config, world_size: int, moe_parallel: str = "tensor") -> None:
        super().check_parallel_layout(config, world_size, moe_parallel)
        if config.moe_layers and moe_parallel == "expert" and config.num_local_experts < world_size:
            raise ValueError(f"num_workers={world_size} exceeds num_local_experts={config.num_local_experts}: "
                             "with moe_parallel='expert' some workers would hold no expert")
