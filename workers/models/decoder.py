"""What the decoder-only model families share: attention over the paged KV cache (with RoPE, QK-norm,
temperature tuning and chunked attention as a family asks), the gated MLP, and the causal LM around
the layers: the forward loop over one flat ragged step, the hidden states a drafter reads, the
logits, the KV cache binding and the checkpoint names of the stacked projections.

A family's module (llama4.py, llama.py) builds its decoder layers from these and subclasses
DecoderForCausalLM; the loader, the runner and the drafters talk to DecoderForCausalLM alone. Plain
torch that knows nothing of serving: `forward(input_ids, positions, step)` returns the final hidden
states, and logits are computed separately for the rows that need them. Sharded over
`comm.world_size` ranks: attention heads and MLP widths tensor-parallel, vocabulary split. Every
reduction is one `allreduce_residual_rmsnorm`, two per decoder layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from warpspec.kernels import PagedAttentionMetadata, batch_invariant, paged_attention, rope_qk_norm, write_kv_cache
from warpspec.workers.distributed.comm import Communicator
from warpspec.workers.kv_groups import KVGroupLayout
from warpspec.workers.layers import (
    CheckpointTensor,
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.rotary import rope_freqs_cis, rope_inv_freq
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


def checkpoint_names(param_name: str) -> list[tuple[str, object]]:
    """Inverse of map_checkpoint_name: the checkpoint tensors (with shard ids) that fill a parameter.

    "model.layers.0.mlp.gate_up_proj.weight" -> [("...gate_proj.weight", 0), ("...up_proj.weight", 1)]
    Routed experts' fused gate_up_proj is stored as is in checkpoints, so it maps to itself."""
    segments = param_name.split(".")
    if "experts" not in segments:
        names = [(ours, theirs, shard) for ours, theirs, shard in STACKED_PARAMS if ours in segments]
        if names:
            i = segments.index(names[0][0])
            return [(".".join(segments[:i] + [theirs] + segments[i + 1:]), shard) for _, theirs, shard in names]
    return [(param_name, None)]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype, *, uses_rope: bool = True,
                 uses_qk_norm: bool = False, temperature_tuning: tuple[float, float] | None = None,
                 chunk_size: int | None = None):
        """uses_qk_norm: an L2 norm of q and k after RoPE (Llama 4's RoPE layers). temperature_tuning:
        (floor_scale, attn_scale) of a layer without RoPE (Llama 4's NoPE layers). chunk_size: attend
        within the query's chunk only (None: full causal attention)."""
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = ColumnParallelLinear.qkv(config.hidden_size, self.head_dim, config.num_attention_heads,
                                                 config.num_key_value_heads, comm, dtype)
        self.num_heads = self.qkv_proj.shard_offsets["q"][1] // self.head_dim  # this rank's heads
        self.num_kv_heads = self.qkv_proj.shard_offsets["k"][1] // self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, comm, dtype)
        self.scale = self.head_dim**-0.5
        self.uses_rope = uses_rope
        self.uses_qk_norm = uses_qk_norm and uses_rope
        self.temperature_tuning = None if uses_rope else temperature_tuning
        self.chunk_size = chunk_size
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
        elif self.temperature_tuning is not None:
            # Longer contexts sharpen NoPE attention: q *= 1 + attn_scale * log1p(floor((p+1) / floor_scale)).
            floor_scale, attn_scale = self.temperature_tuning
            scaled_positions = positions.to(batch_invariant.float_dtype(q))
            scales = torch.log1p(torch.floor((scaled_positions + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k, v


class GatedMLP(nn.Module):
    """SwiGLU MLP: a dense layer's feed-forward (and Llama 4's always-on shared expert). Tensor
    parallel; returns a partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.even(hidden_size, {0: intermediate_size, 1: intermediate_size},
                                                      comm, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, comm, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(batch_invariant.silu_mul(gate, up))


class DecoderModel(nn.Module):
    """The stack under the logits head, named as transformers names it: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype,
                 make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm, dtype)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, comm, dtype)


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM over self.model (DecoderModel). Each layer, made by make_layer(layer
    id), has an input_layernorm, a self_attn (Attention) and is called as layer(positions, normed,
    residual, step, freqs_cis, attn_metas) -> (its feed-forward's partial output, the residual
    stream after attention). A family subclasses it, names its layers, and declares how its
    checkpoints name and lay out tensors."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, comm: Communicator | None,
                 make_layer: Callable[[int], nn.Module]):
        """comm None: one rank."""
        super().__init__()
        self.config = config
        self.comm = comm = comm or Communicator()
        self.model = DecoderModel(config, comm, dtype, make_layer)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.comm, dtype)
        # The logits head's weight when it is stored apart from the head (store_head_columns_contiguous).
        self.head_columns: torch.Tensor | None = None
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim)
        self.num_window_groups = 0  # a hybrid KV cache's chunked groups (bind_kv_cache)

    # ---- what the loader asks of a family ---------------------------------------------------------

    map_checkpoint_name = staticmethod(map_checkpoint_name)
    checkpoint_names = staticmethod(checkpoint_names)

    def adapt_checkpoint_tensor(self, name: str, tensor: CheckpointTensor) -> CheckpointTensor:
        """The tensor as this model's parameter reads it (a family whose checkpoints lay out a tensor
        otherwise wraps it); name: the checkpoint's, prefix stripped."""
        return tensor

    @classmethod
    def check_parallel_layout(cls, config: ModelConfig, world_size: int, moe_parallel: str = "tensor") -> None:
        """Raise before any weight is read if the model cannot be split over world_size ranks."""
        if world_size < 1:
            raise ValueError(f"num_workers must be at least 1, got {world_size}")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % world_size:
            raise ValueError(f"num_workers={world_size} must divide num_attention_heads={heads}")
        if kv_heads % world_size and world_size % kv_heads:
            raise ValueError(f"num_workers={world_size} must divide num_key_value_heads={kv_heads} or be a "
                             "multiple of it (KV heads are then replicated)")
        for name, width in cls.sharded_widths(config).items():
            if width % world_size:
                raise ValueError(f"num_workers={world_size} must divide {name}={width}")

    @classmethod
    def sharded_widths(cls, config: ModelConfig) -> dict[str, int]:
        """The config's widths that tensor parallelism splits over ranks, by name."""
        return {}

    # ---- what the runner and the drafters ask --------------------------------------------------------

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (replicated when there are more ranks than heads)."""
        return self.model.layers[0].self_attn.num_kv_heads

    def embedding_table(self) -> torch.Tensor:
        """The input embedding's weight [vocab (this rank's shard), hidden]."""
        return self.model.embed_tokens.weight

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
