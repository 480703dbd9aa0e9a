"""KV groups: which layers share a block table, and which cache tensor each layer writes.

Llama 4's RoPE layers attend within their `attention_chunk_size` chunk only; its NoPE layers attend
to everything. Keeping every layer's KV for the whole context stores, for the chunked layers, KV
that no query can read again. A hybrid KV cache gives each kind of layer its own block tables over
one shared pool of blocks (vLLM's hybrid allocator has the same shape):

- layers are split into groups of `layers_per_group` layers of one kind: one group of the full-
  attention layers, and as many groups of chunked layers as there are (Maverick: 12 NoPE layers
  and 36 chunked, groups of 12: one full group and three chunked);
- there are `layers_per_group` cache tensors, and the j-th layer of every group writes tensor j. A
  block id therefore names one page in each tensor, and belongs to one group at a time;
- a sequence has one table per group. The full group's covers the whole context; a chunked group's
  keeps only the blocks from the current chunk's start on (core/block_manager.py frees the rest).

Maverick at 128k tokens: 12 x 128k + 36 x 8k token-layers instead of 48 x 128k, 0.30 of the
memory (kv_bytes_per_sequence). The EAGLE-3 draft's KV (one layer, attending fully) follows the
full group's table.

The layout is the one-group case (every layer in group 0, one tensor per layer, as before the
hybrid cache) when it is turned off, when no chunk is shorter than the model's context, or when the
full layers cannot form one group (their count must divide the chunked layers' count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warpspec.workers.model_config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    layer_ids: tuple[int, ...]  # layer_ids[j] writes cache tensor j
    chunk_size: int | None  # None: full attention, the table covers the whole context

    @property
    def name(self) -> str:
        return "full attention" if self.chunk_size is None else f"chunked attention ({self.chunk_size})"


@dataclass(frozen=True)
class KVGroupLayout:
    groups: tuple[KVGroup, ...]  # groups[0] attends fully (the draft's KV follows its table)
    num_tensors: int  # cache tensors, one page of each per block

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def num_window_groups(self) -> int:
        """Groups after the first: each with a table per sequence that starts at its chunk."""
        return len(self.groups) - 1

    @property
    def chunk_size(self) -> int | None:
        """The chunked groups' chunk; None for one group."""
        return self.groups[1].chunk_size if self.is_hybrid else None

    def placement(self, layer_id: int) -> tuple[int, int]:
        """(group, tensor) of a layer."""
        for group_id, group in enumerate(self.groups):
            if layer_id in group.layer_ids:
                return group_id, group.layer_ids.index(layer_id)
        raise ValueError(f"layer {layer_id} is in no KV group")

    def blocks_for(self, num_tokens: int, block_size: int, max_step_tokens: int) -> list[int]:
        """Blocks each group holds for one sequence of num_tokens tokens at its widest step: the
        whole context for the full group; for a chunked one, its chunk plus a step of
        max_step_tokens (a prefill chunk writes every position it runs before the step frees the
        chunks behind it), and the block a chunk start splits."""
        whole = -(-num_tokens // block_size)
        return [whole if group.chunk_size is None
                else min(whole, -(-(group.chunk_size + max_step_tokens) // block_size) + 1)
                for group in self.groups]

    def describe_need(self, needs: list[int]) -> str:
        """'34 (full attention 32, 2 chunked attention (8) groups 1 each)' for a blocks_for result."""
        if not self.is_hybrid:
            return str(needs[0])
        return (f"{sum(needs)} ({self.groups[0].name} {needs[0]}, {self.num_window_groups} "
                f"{self.groups[1].name} groups {max(needs[1:])} each)")


def kv_group_layout(config: ModelConfig, hybrid: bool = True) -> KVGroupLayout:
    """The model's KV groups; one group unless hybrid and chunked layers would drop KV (see the module)."""
    every_layer = KVGroupLayout((KVGroup(tuple(range(config.num_hidden_layers)), None),), config.num_hidden_layers)
    chunked = [i for i in range(config.num_hidden_layers)
               if (config.chunk_size(i) or math.inf) < config.max_position_embeddings]
    full = [i for i in range(config.num_hidden_layers) if i not in chunked]
    if not hybrid or not chunked or not full or len(chunked) % len(full):
        return every_layer
    size = len(full)
    groups = [KVGroup(tuple(full), None)]
    groups += [KVGroup(tuple(chunked[start : start + size]), config.attention_chunk_size)
               for start in range(0, len(chunked), size)]
    return KVGroupLayout(tuple(groups), size)


def kv_bytes_per_token_layer(config: ModelConfig, dtype_bytes: int, num_kv_heads: int | None = None) -> int:
    """Keys and values of one token in one layer (num_kv_heads: a rank's share; all by default)."""
    return 2 * (num_kv_heads or config.num_key_value_heads) * config.head_dim * dtype_bytes


def kv_bytes_per_sequence(config: ModelConfig, num_tokens: int, dtype_bytes: int, block_size: int = 16,
                          hybrid: bool = True) -> int:
    """KV bytes one sequence of num_tokens holds between steps (decoding, whole blocks), whole model.
    A chunked group holds its current chunk's blocks; a chunk start inside a block keeps that block."""
    layout = kv_group_layout(config, hybrid)
    blocks = 0
    for group in layout.groups:
        first = 0 if group.chunk_size is None else (num_tokens - 1) // group.chunk_size * group.chunk_size
        blocks += -(-num_tokens // block_size) - first // block_size
    return blocks * block_size * layout.num_tensors * kv_bytes_per_token_layer(config, dtype_bytes)
