"""Building blocks of the model. Each layer owns its parameters, knows which part of a checkpoint
tensor belongs to its rank, and reads only that part (`weight_loader`). Parameters start as
torch.empty: memory is paid for only when the loader writes it.

Parallel layout over `comm.world_size` ranks (a single process is world_size 1, where every rule
below selects the whole tensor):
- column-parallel: output features split, each rank computes its slice of the output;
- row-parallel: input features split, each rank produces a partial sum that the next
  `allreduce_residual_rmsnorm` reduces (so there is no collective inside the layer);
- vocab-parallel embedding / lm_head: vocabulary rows split.

Linear layers may hold FP8 weights (workers/quantization.py converts them before loading): weight
float8_e4m3fn [out, in] and weight_scale float32 [out], one scale per output row. Their loaders take
an FP8 checkpoint tensor as it is (its scale is a tensor of its own) and quantize anything else row
by row as it is read, so no full-precision copy of the model ever exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from warpspec.kernels import batch_invariant
from warpspec.kernels.fp8 import FP8_DTYPE, fp8_linear, quantize_fp8, quantize_fp8_columns
from warpspec.kernels.transpose import transpose
from warpspec.workers.distributed.comm import Communicator
from warpspec.workers.errors import CheckpointError


class CheckpointTensor:
    """A tensor in a checkpoint file (a safetensors slice), read only in the slices asked for."""

    def __init__(self, source, shape: tuple[int, ...]):
        self.source = source
        self.shape = tuple(shape)
        self.bytes_read = 0
        self.dtype: torch.dtype | None = None  # known once read

    def read(self, *index: slice) -> torch.Tensor:
        out = self.source[index] if index else self.source[:]
        self.bytes_read += out.numel() * out.element_size()
        self.dtype = out.dtype
        return out


def even_split(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part when total need not divide: 6 over 4 ranks -> 2, 2, 1, 1."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def check_shape(name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
    if tuple(expected) != tuple(got):
        raise CheckpointError(f"shape mismatch for {name}: expected {list(expected)}, got {list(got)}")


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = replicated_weight_loader
    return param


def replicated_weight_loader(param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
    check_shape(name, tuple(param.shape), loaded.shape)
    load_rows(param, loaded, name, slice(None))


def load_rows(param: nn.Parameter, loaded: CheckpointTensor, name: str, rows: slice, *index: slice,
              scale: nn.Parameter | None = None) -> None:
    """param[rows] = loaded[index]. An FP8 param (with its scale [out]) takes FP8 checkpoint data as is
    and quantizes other data per row, writing the rows' scales to scale[rows]."""
    data = loaded.read(*index)
    is_fp8_data = data.dtype == FP8_DTYPE
    if param.dtype != FP8_DTYPE and is_fp8_data:
        raise CheckpointError(f"{name} is float8_e4m3fn, but warpspec keeps this module in full precision")
    if param.dtype != FP8_DTYPE or is_fp8_data:
        param.data[rows].copy_(data)
        return
    weight, weight_scale = quantize_fp8(data.to(param.device))
    param.data[rows].copy_(weight)
    scale.data[rows].copy_(weight_scale)


def load_experts(param: nn.Parameter, loaded: CheckpointTensor, name: str, first: int,
                 scale: nn.Parameter | None = None, rows: slice = slice(None), cols: slice = slice(None),
                 into: slice = slice(None)) -> None:
    """param[:, :, into] [num_local, in, out] = loaded[first : first + num_local, rows, cols]. FP8
    experts are quantized per output channel (over the rows read) one expert at a time, so the
    float32 copy that quantizing makes stays one expert's size."""
    num_local = param.shape[0]
    if param.dtype != FP8_DTYPE:
        data = loaded.read(slice(first, first + num_local), rows, cols)
        if data.dtype == FP8_DTYPE:
            raise CheckpointError(f"{name} is float8_e4m3fn, but warpspec keeps this module in full precision")
        if param.stride(1) != 1:
            param.data[:, :, into].copy_(data)
            return
        for e in range(num_local):  # input-major experts (Llama4Experts.lay_out_inputs_contiguous)
            copy_transposed(param.data[e, :, into], data[e])
        return
    for e in range(num_local):
        data = loaded.read(slice(first + e, first + e + 1), rows, cols)[0]
        if data.dtype == FP8_DTYPE:
            copy_transposed(param.data[e, :, into], data)
        else:
            weight, weight_scale = quantize_fp8_columns(data.to(param.device))
            copy_transposed(param.data[e, :, into], weight)
            scale.data[e, into].copy_(weight_scale)


# Rows of the source per block of torch's transposing copy, where kernels/transpose.py is not available:
# the fastest of 16 .. 512 on the 2-core machine (a [1024, 2048] bf16 expert: 2.6 GB/s, against 0.9 for
# one 2D copy and 0.56 for a 3D one).
TRANSPOSE_ROWS = 256


def copy_transposed(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for 2D tensors. A dst stored transposed (stride 1 along its rows) is written by
    kernels/transpose.py (4.0-4.8 GB/s on 2 cores) or, without a C compiler, in blocks of TRANSPOSE_ROWS
    source rows, each block's reads and writes fitting the caches: one strided copy of the whole took
    2.7 of a 2 GB checkpoint's 5.2 s load (`warpspec bench weights`)."""
    if dst.stride(0) != 1 or dst.shape[1] == 1:
        dst.copy_(src)
        return
    out, src = dst.t(), src.to(dst.dtype)  # out [cols, rows], rows contiguous
    if transpose(src, out):
        return
    for start in range(0, src.shape[0], TRANSPOSE_ROWS):
        out[:, start:start + TRANSPOSE_ROWS].copy_(src[start:start + TRANSPOSE_ROWS].t())


def load_scale_rows(param: nn.Parameter, loaded: CheckpointTensor, name: str, rows: slice, full_rows: int,
                    src_rows: slice) -> None:
    """A checkpoint's per-row weight_scale, [full_rows, 1] in fbgemm's layout (or [full_rows]):
    src_rows of it into param[rows]."""
    if loaded.shape not in ((full_rows, 1), (full_rows,)):
        check_shape(name, (full_rows, 1), loaded.shape)
    param.data[rows].copy_(loaded.read(src_rows).reshape(-1))


class Linear(nn.Module):
    """y = x @ W.T, W in nn.Linear layout [out_features, in_features], no bias, held whole."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.weight.weight_loader = self.weight_loader
        # Set when the weight is FP8: [out] float32 scales, and a cap on activations' per-token amax.
        self.weight_scale: nn.Parameter | None = None
        self.activation_scale_ub: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.activation_scale_ub)
        return batch_invariant.linear(x, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        check_shape(name, tuple(self.weight.shape), loaded.shape)
        load_rows(param, loaded, name, slice(None), scale=self.weight_scale)

    def scale_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        load_scale_rows(param, loaded, name, slice(None), param.shape[0], slice(None))


class ColumnParallelLinear(Linear):
    """Several checkpoint matrices stacked along the output dim, each split across ranks by rows.

    `shards` maps shard id -> (rows in the checkpoint tensor, [start, end) of them on this rank):
    gate_up_proj over 2 ranks, rank 1 = {0: (I, (I/2, I)), 1: (I, (I/2, I))} holds the second half of
    gate_proj then the second half of up_proj."""

    def __init__(self, in_features: int, shards: dict[object, tuple[int, tuple[int, int]]], dtype: torch.dtype):
        self.shards = shards
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, (_, (start, end)) in shards.items():
            self.shard_offsets[shard_id] = (offset, end - start)
            offset += end - start
        super().__init__(in_features, offset, dtype)

    @classmethod
    def even(cls, in_features: int, shard_sizes: dict[object, int], comm: Communicator,
             dtype: torch.dtype) -> ColumnParallelLinear:
        """Each shard split into world_size equal row blocks."""
        shards = {}
        for shard_id, size in shard_sizes.items():
            local = size // comm.world_size
            shards[shard_id] = (size, (comm.rank * local, (comm.rank + 1) * local))
        return cls(in_features, shards, dtype)

    @classmethod
    def qkv(cls, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, comm: Communicator,
            dtype: torch.dtype) -> ColumnParallelLinear:
        """q_proj, k_proj, v_proj stacked and split by attention head. With more ranks than KV heads,
        KV heads are replicated: 8 query / 2 KV heads on 4 ranks -> rank r holds query heads 2r, 2r+1
        and KV head r // 2 (the one those query heads read)."""
        q_local = num_heads // comm.world_size
        kv_local = max(1, num_kv_heads // comm.world_size)
        first_kv = comm.rank * num_kv_heads // comm.world_size
        q_rows = (comm.rank * q_local * head_dim, (comm.rank + 1) * q_local * head_dim)
        kv_rows = (first_kv * head_dim, (first_kv + kv_local) * head_dim)
        return cls(hidden, {"q": (num_heads * head_dim, q_rows), "k": (num_kv_heads * head_dim, kv_rows),
                            "v": (num_kv_heads * head_dim, kv_rows)}, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        full_rows, (start, end) = self.shards[shard_id]
        check_shape(name, (full_rows, param.shape[1]), loaded.shape)
        offset, size = self.shard_offsets[shard_id]
        load_rows(param, loaded, name, slice(offset, offset + size), slice(start, end), scale=self.weight_scale)

    def scale_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        """The scales of the rows this rank holds, placed like the rows themselves."""
        full_rows, (start, end) = self.shards[shard_id]
        offset, size = self.shard_offsets[shard_id]
        load_scale_rows(param, loaded, name, slice(offset, offset + size), full_rows, slice(start, end))


class RowParallelLinear(Linear):
    """Input features split across ranks; the output is this rank's partial sum, reduced later by the
    fused all-reduce + residual + RMSNorm."""

    def __init__(self, in_features: int, out_features: int, comm: Communicator, dtype: torch.dtype):
        self.in_full = in_features
        local = in_features // comm.world_size
        self.cols = (comm.rank * local, (comm.rank + 1) * local)
        super().__init__(local, out_features, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        """Quantized online, each rank's scales are the amax of its own columns (finer than the whole
        row's); an FP8 checkpoint's whole-row scales apply to every column slice as they are."""
        check_shape(name, (param.shape[0], self.in_full), loaded.shape)
        load_rows(param, loaded, name, slice(None), slice(None), slice(*self.cols), scale=self.weight_scale)


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks in equal, padded shards, as vLLM pads them: every rank holds
    shard_size = ceil(vocab / world_size) rows, rank r the ids [r * shard_size, (r + 1) * shard_size),
    and rows past the vocabulary are zero. 513 ids over 2 ranks -> 257 + 256 real rows, 257 each.
    Equal shards are what the gathers need (gloo's gather and NCCL's all-gather take one size from
    every rank), and rank order is vocabulary order, so the gathered logits are the vocabulary's
    followed by padding, cut off by `trim_logits`.

    Looking up a token another rank owns gives zeros here; the sum over ranks is the embedding. The
    lm_head has the same layout (its own weight, or this one when embeddings are tied)."""

    def __init__(self, vocab_size: int, hidden: int, comm: Communicator, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.world_size = comm.world_size
        self.shard_size = -(-vocab_size // comm.world_size)
        self.start = min(comm.rank * self.shard_size, vocab_size)
        self.end = min(self.start + self.shard_size, vocab_size)
        self.weight = empty_param(self.shard_size, hidden, dtype=dtype)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard_id=None) -> None:
        check_shape(name, (self.vocab_size, param.shape[1]), loaded.shape)
        num_real = self.end - self.start
        param.data[:num_real].copy_(loaded.read(slice(self.start, self.end)))
        param.data[num_real:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden], partial over ranks when world_size > 1."""
        if self.world_size == 1:
            return F.embedding(input_ids, self.weight)
        is_local = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(is_local, input_ids - self.start, 0)
        return F.embedding(local_ids, self.weight) * is_local[:, None].to(self.weight.dtype)

    def trim_logits(self, gathered: torch.Tensor) -> torch.Tensor:
        """[n, world_size * shard_size] gathered over ranks -> [n, vocab]: the padding columns dropped."""
        return gathered[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """Called with (partial, residual): the fused all-reduce + residual add + RMSNorm that follows
    every row-parallel output; returns (normed, new_residual)."""

    def __init__(self, hidden_size: int, eps: float, comm: Communicator, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype)
        self.eps = eps
        self.comm = comm

    def forward(self, partial: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.comm.allreduce_residual_rmsnorm(partial, residual, self.weight, self.eps)
