"""Llama 4 text decoder (transformers' Llama4ForCausalLM), plain torch over a paged KV cache.

Knows nothing of serving: `forward(input_ids, positions, step)` runs one flat ragged batch and
returns the final hidden states; logits are computed separately for the rows that need them.
Sharded over `comm.world_size` ranks: attention heads and MLP widths tensor-parallel, routed experts
split by width too (moe_parallel="tensor") or whole (moe_parallel="expert"), vocabulary split. Every
reduction is one `allreduce_residual_rmsnorm`, two per decoder layer (after attention, after the
feed-forward).
"""

from __future__ import annotations

import torch
from torch import nn

from warpspec.kernels import (
    PagedAttentionMetadata,
    batch_invariant,
    moe_experts,
    paged_attention,
    rope_qk_norm,
    route_topk_sigmoid,
    write_kv_cache,
)
from warpspec.workers.comm import Communicator
from warpspec.workers.kv_groups import KVGroupLayout
from warpspec.workers.layers import (
    CheckpointTensor,
    ColumnParallelLinear,
    Linear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_shape,
    empty_param,
    even_split,
    load_experts,
)
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.rope import rope_freqs_cis, rope_inv_freq
from warpspec.workers.step import StepInput

# Checkpoint tensors that land in a slice of a stacked parameter: (our name, checkpoint name, shard).
# Matched on whole dotted segments, so "experts.gate_up_proj" is never mistaken for "up_proj".
STACKED_PARAMS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def map_checkpoint_name(name: str) -> tuple[str, object]:
    """Checkpoint tensor name (prefix already stripped) -> (our parameter name, shard id).

    "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "k")"""
    segments = name.split(".")
    for ours, theirs, shard_id in STACKED_PARAMS:
        if theirs in segments:
            segments[segments.index(theirs)] = ours
            return ".".join(segments), shard_id
    return name, None


class Llama4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, comm: Communicator, dtype: torch.dtype):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = ColumnParallelLinear.qkv(config.hidden_size, self.head_dim, config.num_attention_heads,
                                                 config.num_key_value_heads, comm, dtype)
        self.num_heads = self.qkv_proj.shard_offsets["q"][1] // self.head_dim  # this rank's heads
        self.num_kv_heads = self.qkv_proj.shard_offsets["k"][1] // self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, comm, dtype)
        self.scale = self.head_dim**-0.5
        self.uses_rope = config.uses_rope(layer_id)
        self.uses_qk_norm = config.use_qk_norm and self.uses_rope
        self.uses_temperature_tuning = config.attn_temperature_tuning and not self.uses_rope
        self.chunk_size = config.chunk_size(layer_id)
        self.floor_scale = config.floor_scale
        self.attn_scale = config.attn_scale
        self.eps = config.rms_norm_eps
        # [2, num_blocks, block_size, num_kv_heads, head_dim], bound by the runner, and the KV group
        # whose block tables index it (workers/kv_groups.py; 0 unless the cache is hybrid).
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, step: StepInput,
                freqs_cis: torch.Tensor, attn_metas: list[PagedAttentionMetadata]) -> torch.Tensor:
        """attn_metas: the step's attention metadata per KV group."""
        q, k, v = self.project_qkv(positions, hidden, freqs_cis)
        slots = step.slot_mapping if self.kv_group == 0 else step.window_slot_mapping[:, self.kv_group - 1]
        write_kv_cache(k, v, self.kv_cache, slots)
        out = paged_attention(q, self.kv_cache[0], self.kv_cache[1], attn_metas[self.kv_group], self.scale,
                              self.chunk_size)
        return self.o_proj(out.reshape(hidden.shape[0], -1))

    def project_qkv(self, positions: torch.Tensor, hidden: torch.Tensor,
                    freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden] -> q [num_tokens, heads, head_dim], k and v [num_tokens,
        kv_heads, head_dim], positional treatment applied (shared by serving and training)."""
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.uses_rope:
            q, k = rope_qk_norm(q, k, freqs_cis, self.eps if self.uses_qk_norm else None)
        elif self.uses_temperature_tuning:
            # Longer contexts sharpen NoPE attention: q *= 1 + attn_scale * log1p(floor((p+1) / floor_scale)).
            scaled_positions = positions.to(batch_invariant.float_dtype(q))
            scales = torch.log1p(torch.floor((scaled_positions + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k, v


class Llama4MLP(nn.Module):
    """SwiGLU MLP: the dense layers' feed-forward and the MoE's always-on shared expert. Tensor
    parallel; returns a partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.even(hidden_size, {0: intermediate_size, 1: intermediate_size},
                                                      comm, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, comm, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(batch_invariant.silu_mul(gate, up))


class Llama4Experts(nn.Module):
    """Routed experts in the checkpoint's fused layout, gate_up_proj [E, H, 2I] and down_proj [E, I, H].
    FP8 experts (workers/quantization.py) add per-output-channel scales gate_up_proj_scale [E, 2I]
    and down_proj_scale [E, H] (fbgemm checkpoints store them as [E, 1, 2I] and [E, H, 1]).

    moe_parallel="tensor": every rank holds every expert's slice of the intermediate width, as the
    shared expert is split: gate and up columns [r * I/N, (r + 1) * I/N) side by side, and the same
    rows of down_proj. Each rank reads 1/N of every chosen expert and returns a partial sum that the
    layer's all-reduce completes. moe_parallel="expert": this rank holds whole experts [first_expert,
    end_expert) (6 over 4 ranks: 2, 2, 1, 1); the rank owning a chosen expert reads all of it."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype, moe_parallel: str = "tensor"):
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

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype, moe_parallel: str = "tensor"):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Linear(config.hidden_size, config.num_local_experts, dtype)
        self.experts = Llama4Experts(config, comm, dtype, moe_parallel)
        self.shared_expert = Llama4MLP(config.hidden_size, config.intermediate_size, comm, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, scores = route_topk_sigmoid(self.router(x), self.top_k)
        routed = moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, expert_ids, scores,
                             first_expert=self.experts.first_expert, gate_up_scale=self.experts.gate_up_proj_scale,
                             down_scale=self.experts.down_proj_scale)
        return self.shared_expert(x) + routed


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, comm: Communicator, dtype: torch.dtype,
                 moe_parallel: str = "tensor"):
        super().__init__()
        self.self_attn = Llama4Attention(config, layer_id, comm, dtype)
        if config.is_moe_layer(layer_id):
            self.feed_forward: nn.Module = Llama4MoE(config, comm, dtype, moe_parallel)
        else:
            self.feed_forward = Llama4MLP(config.hidden_size, config.intermediate_size_mlp, comm, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)

    def forward(self, positions: torch.Tensor, normed: torch.Tensor, residual: torch.Tensor, step: StepInput,
                freqs_cis: torch.Tensor, attn_metas: list[PagedAttentionMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
        """normed: input_layernorm's output (the model applies it, fused with the previous layer's
        reduction); returns the feed-forward's partial output and the residual stream after attention."""
        hidden = self.self_attn(positions, normed, step, freqs_cis, attn_metas)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class Llama4Model(nn.Module):
    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype, moe_parallel: str = "tensor"):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm, dtype)
        self.layers = nn.ModuleList(Llama4DecoderLayer(config, i, comm, dtype, moe_parallel)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)


class Llama4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, comm: Communicator | None = None,
                 moe_parallel: str = "tensor"):
        super().__init__()
        self.config = config
        self.comm = comm or Communicator()
        self.model = Llama4Model(config, self.comm, dtype, moe_parallel)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.comm, dtype)
        # The logits head's weight when it is stored apart from the head (store_head_columns_contiguous).
        self.head_columns: torch.Tensor | None = None
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)
        self.num_window_groups = 0  # a hybrid KV cache's chunked groups (bind_kv_cache)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepInput,
                aux_layer_ids: tuple[int, ...] = (),
                attn_meta: PagedAttentionMetadata | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions [num_tokens] -> final normed hidden [num_tokens, hidden] and, for each
        layer id in aux_layer_ids (in the order given, repeats allowed), the residual stream ENTERING
        that layer [num_tokens, hidden] (EAGLE-3's features; id == num_layers: the stream before the
        final norm). attn_meta: the step's attention metadata when the caller built it (a compiled step
        declares its queries uniform)."""
        freqs_cis = rope_freqs_cis(positions, self.inv_freq)
        block_size = self.model.layers[0].self_attn.kv_cache.shape[2]
        if attn_meta is None:
            attn_meta = PagedAttentionMetadata(step.query_start_loc, step.seq_lens, step.block_tables, block_size,
                                               step.max_query_len, step.max_seq_len, num_tokens=input_ids.shape[0])
        attn_metas = [attn_meta]
        if self.num_window_groups and step.window_tables is None:
            raise ValueError(f"this model's KV cache is hybrid ({self.num_window_groups} chunked KV groups), but the "
                             "step carries no window tables: build it with each sequence's window_tables and the "
                             "chunk size (StepInput.build)")
        if step.window_tables is not None:  # a hybrid KV cache: each chunked group over its window tables
            window_len = step.window_tables.shape[2] * block_size
            for group in range(step.window_tables.shape[1]):
                attn_metas.append(attn_meta.over_tables(step.window_tables[:, group], window_len, step.window_starts,
                                                        like=attn_metas[1] if group else None))
        # The embedding is a partial sum over vocabulary shards; layer 0's input norm reduces it.
        hidden, residual = self.model.embed_tokens(input_ids), None
        captured: dict[int, torch.Tensor] = {}
        for layer_id, layer in enumerate(self.model.layers):
            # Reduce the previous partial, add it to the stream, normalise: one collective. After it,
            # `residual` is the full stream entering this layer, the value EAGLE-3 captures.
            normed, residual = layer.input_layernorm(hidden, residual)
            if layer_id in aux_layer_ids:
                captured[layer_id] = residual
            hidden, residual = layer(positions, normed, residual, step, freqs_cis, attn_metas)
        hidden, residual = self.model.norm(hidden, residual)
        captured[len(self.model.layers)] = residual
        return hidden, [captured[i] for i in aux_layer_ids]

    def store_head_columns_contiguous(self) -> None:
        """Lay the logits head's weight out with the vocabulary dimension contiguous, [hidden, vocab] in
        memory (its shape unchanged), for a CPU's GEMMs of a few rows. Stored as loaded, [vocab,
        hidden], MKL's product slows with every row beyond two; the bundled target's [n, 256] x
        [256, 8192], compiled, 2 threads: 1 / 4 / 8 / 32 rows in 216 / 253 / 269 / 619 us against
        219 / 367 / 517 / 732. A tied head keeps the embedding table as it is for the lookups (a
        strided row gather each) and reads a copy: vocab x hidden more memory."""
        if self.lm_head is None:
            table = self.model.embed_tokens.weight.detach()
            self.head_columns = table.t().contiguous().t()
        else:
            self.lm_head.weight.data = self.lm_head.weight.data.t().contiguous().t()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_logits, hidden] -> [num_logits, vocab] float32 on rank 0; None on other ranks."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        weight = head.weight if self.head_columns is None else self.head_columns
        local = batch_invariant.linear(hidden, weight).float()
        gathered = self.comm.gather(local, dim=-1)
        return None if gathered is None else head.trim_logits(gathered)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor], layout: KVGroupLayout | None = None) -> None:
        """kv_caches: one tensor per layer, or the layout's tensors, shared by its groups."""
        for layer_id, layer in enumerate(self.model.layers):
            group, tensor = layout.placement(layer_id) if layout is not None else (0, layer_id)
            layer.self_attn.kv_cache, layer.self_attn.kv_group = kv_caches[tensor], group
        self.num_window_groups = layout.num_window_groups if layout is not None else 0


def checkpoint_names(param_name: str) -> list[tuple[str, object]]:
    """Inverse of map_checkpoint_name: the checkpoint tensors (with shard ids) that fill a parameter.

    "model.layers.0.mlp.gate_up_proj.weight" -> [("...gate_proj.weight", 0), ("...up_proj.weight", 1)]
    The routed experts' fused gate_up_proj is stored as is in checkpoints, so it maps to itself."""
    segments = param_name.split(".")
    if "experts" not in segments:
        names = [(ours, theirs, shard) for ours, theirs, shard in STACKED_PARAMS if ours in segments]
        if names:
            i = segments.index(names[0][0])
            return [(".".join(segments[:i] + [theirs] + segments[i + 1:]), shard) for _, theirs, shard in names]
    return [(param_name, None)]


def check_parallel_layout(config: ModelConfig, world_size: int, moe_parallel: str = "tensor") -> None:
    """Raise before any weight is read if the model cannot be split over world_size ranks."""
    if world_size < 1:
        raise ValueError(f"num_workers must be at least 1, got {world_size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        raise ValueError(f"num_workers={world_size} must divide num_attention_heads={heads}")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"num_workers={world_size} must divide num_key_value_heads={kv_heads} or be a "
                         "multiple of it (KV heads are then replicated)")
    widths = {}
    if config.moe_layers:  # the shared expert's width, and with moe_parallel="tensor" every routed expert's
        widths["intermediate_size"] = config.intermediate_size
    if len(config.moe_layers) < config.num_hidden_layers:
        widths["intermediate_size_mlp"] = config.intermediate_size_mlp
    for name, width in widths.items():
        if width % world_size:
            raise ValueError(f"num_workers={world_size} must divide {name}={width}")
    if config.moe_layers and moe_parallel == "expert" and config.num_local_experts < world_size:
        raise ValueError(f"num_workers={world_size} exceeds num_local_experts={config.num_local_experts}: "
                         "with moe_parallel='expert' some workers would hold no expert")
