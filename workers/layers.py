"""Building blocks of the model, each owning its parameters and a `weight_loader` that copies a
checkpoint tensor into them. Parameters are allocated with torch.empty: nothing is touched (or paid
for in memory) until the loader writes it.

Sharding across workers lives here too, once it exists: a single-process run is the degenerate
case in which every layer holds the whole tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warpspec.kernels import add_rms_norm, rms_norm
from warpspec.workers.errors import CheckpointError


def _check_shape(name: str, expected: torch.Size | tuple[int, ...], got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise CheckpointError(f"shape mismatch for {name}: expected {list(expected)}, got {list(got)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: object = None) -> None:
    _check_shape(name, param.shape, loaded.shape)
    param.data.copy_(loaded)


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_weight_loader
    return param


class Linear(nn.Module):
    """y = x @ W.T with W in nn.Linear layout [out_features, in_features], no bias.

    `shard_sizes` stacks several checkpoint matrices along the output dim, so one matmul does the
    work of many: qkv_proj = {"q": Hq*D, "k": Hkv*D, "v": Hkv*D} holds q_proj, k_proj, v_proj."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 shard_sizes: dict[object, int] | None = None):
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in (shard_sizes or {}).items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        if shard_sizes and offset != out_features:
            raise ValueError(f"shard sizes sum to {offset}, not out_features {out_features}")
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: object = None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded, name)
            return
        offset, size = self.shard_offsets[shard_id]
        _check_shape(name, (size, param.shape[1]), loaded.shape)
        param.data[offset : offset + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm; called with a residual it is the fused "add the residual, then normalise" op that
    follows every row-parallel projection (and, sharded, the all-reduce before it)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
