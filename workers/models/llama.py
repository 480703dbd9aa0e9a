"""Llama (transformers' LlamaForCausalLM: Llama 2 and 3 and models built on them): dense decoder
layers, RoPE attention at every layer, a SwiGLU MLP.

Its checkpoints keep each head's q_proj and k_proj rows in rotate-half order: dimension i pairs with
i + head_dim / 2 under RoPE. Attention here rotates interleaved pairs (2i, 2i + 1), as Llama 4's
checkpoints are laid out. So loading re-orders each head's rows, [x0 x1 .. | y0 y1 ..] -> [x0 y0 x1
y1 ..]: q and k take the same order, which leaves every dot product between them, and so the
attention, unchanged, and RoPE on the interleaved pairs is RoPE on the halves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from warpspec.kernels import PagedAttentionMetadata
from warpspec.workers.distributed.comm import Communicator
from warpspec.workers.errors import CheckpointError
from warpspec.workers.layers import CheckpointTensor, RMSNorm
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.decoder import Attention, DecoderForCausalLM, GatedMLP
from warpspec.workers.step import StepInput

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)  # a config.json that names no architecture


@dataclass(kw_only=True)
class LlamaConfig(ModelConfig):
    intermediate_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("intermediate_size",))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key):
                raise CheckpointError(f"config.json: {key} is true; warpspec's Llama layers have no biases")
        if "intermediate_size" not in raw:
            raise CheckpointError("config.json is missing required key 'intermediate_size'")
        return cls(**ModelConfig.common_fields(raw, raw), architecture="LlamaForCausalLM",
                   intermediate_size=int(raw["intermediate_size"]))


class InterleavedHeadRows:
    """A q_proj or k_proj tensor (or its per-row FP8 scales) read with each head's rows in
    interleaved order (module docstring); reads are of whole heads, as the attention's shards are."""

    def __init__(self, tensor: CheckpointTensor, head_dim: int):
        self.tensor, self.head_dim = tensor, head_dim
        self.shape = tensor.shape

    @property
    def bytes_read(self) -> int:
        return self.tensor.bytes_read

    @property
    def dtype(self) -> torch.dtype | None:
        return self.tensor.dtype

    def read(self, *index: slice) -> torch.Tensor:
        data = self.tensor.read(*index)
        halves = data.view(data.shape[0] // self.head_dim, 2, self.head_dim // 2, *data.shape[1:])
        return halves.transpose(1, 2).reshape(data.shape)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, comm: Communicator, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(config, comm, dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, comm, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)

    def forward(self, positions: torch.Tensor, normed: torch.Tensor, residual: torch.Tensor, step: StepInput,
                freqs_cis: torch.Tensor, attn_metas: list[PagedAttentionMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama4DecoderLayer.forward: the MLP's partial output and the stream after attention."""
        hidden = self.self_attn(positions, normed, step, freqs_cis, attn_metas)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(DecoderForCausalLM):
    config_class = LlamaConfig

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, comm: Communicator | None = None,
                 moe_parallel: str = "tensor"):
        """moe_parallel: unused (no experts), taken as every family's constructor takes it."""
        super().__init__(config, dtype, comm, lambda layer_id: LlamaDecoderLayer(config, self.comm, dtype))

    def adapt_checkpoint_tensor(self, name: str, tensor: CheckpointTensor) -> CheckpointTensor:
        if name.split(".")[-2:-1] in (["q_proj"], ["k_proj"]):  # the weight, or its FP8 scales
            return InterleavedHeadRows(tensor, self.config.head_dim)
        return tensor

    @classmethod
    def sharded_widths(cls, config: LlamaConfig) -> dict[str, int]:
        return {"intermediate_size": config.intermediate_size}
