"""KV groups (workers/kv_groups.py): which layers share a table and a cache tensor, and the memory a
sequence holds, on Llama 4's real shapes and on the scaled-down configs the other tests run."""

from __future__ import annotations

import pytest

from warpspec.errors import CheckpointError
from warpspec.workers.kv_groups import kv_bytes_per_sequence, kv_group_layout
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.registry import model_config_from_dict

# The attention shapes of Llama 4 Maverick's and Scout's text configs (Hugging Face config.json):
# 48 layers, every fourth NoPE (no_rope_layer_interval 4), 8 KV heads of 128, chunk 8192.
LLAMA4 = dict(model_type="llama4_text", vocab_size=202048, hidden_size=5120, intermediate_size=8192,
              intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
              head_dim=128, attention_chunk_size=8192)
MAVERICK = dict(LLAMA4, num_local_experts=128, interleave_moe_layer_step=2, max_position_embeddings=1048576)


def config(**overrides) -> ModelConfig:
    return model_config_from_dict({**MAVERICK, **overrides})


def test_maverick_has_one_full_group_and_three_chunked_groups_of_twelve_layers():
    layout = kv_group_layout(config())
    assert [group.chunk_size for group in layout.groups] == [None, 8192, 8192, 8192]
    assert layout.groups[0].layer_ids == tuple(range(3, 48, 4))  # the NoPE layers
    assert layout.num_tensors == 12 and layout.num_window_groups == 3
    # Layer 0 is the first chunked layer: group 1, tensor 0; layer 7 is the second NoPE: group 0, tensor 1.
    assert layout.placement(0) == (1, 0) and layout.placement(7) == (0, 1)
    # The chunked layers in order fill groups 1..3, twelve each: layer 16 is the 13th chunked layer.
    assert layout.placement(16) == (2, 0)


def test_the_hybrid_cache_holds_three_tenths_of_the_kv_at_128k_and_a_quarter_at_1m():
    maverick = config()
    # 12 x 128k + 36 x 8k token-layers against 48 x 128k: (12 + 36 / 16) / 48 = 0.297.
    at_128k = kv_bytes_per_sequence(maverick, 131072, 2) / kv_bytes_per_sequence(maverick, 131072, 2, hybrid=False)
    assert at_128k == pytest.approx(14.25 / 48)
    at_1m = kv_bytes_per_sequence(maverick, 1048576, 2) / kv_bytes_per_sequence(maverick, 1048576, 2, hybrid=False)
    assert at_1m == pytest.approx((12 + 36 / 128) / 48)
    # Within the first chunk nothing is saved.
    assert kv_bytes_per_sequence(maverick, 8192, 2) == kv_bytes_per_sequence(maverick, 8192, 2, hybrid=False)
    # Full cache, bf16: 48 layers x 2 x 8 heads x 128 x 2 bytes = 192 KiB per token.
    assert kv_bytes_per_sequence(maverick, 16, 2, hybrid=False) == 16 * 48 * 2 * 8 * 128 * 2


@pytest.mark.parametrize("overrides,why", [
    ({"max_position_embeddings": 8192}, "no chunk is shorter than the context"),
    ({"num_hidden_layers": 5, "no_rope_layers": [1, 0, 1, 0, 1]}, "2 full layers do not divide 3 chunked"),
    ({"no_rope_layers": [1] * 48}, "no full-attention layer"),
])
def test_one_group_where_a_hybrid_cache_saves_nothing_or_cannot_be_laid_out(overrides, why):
    layout = kv_group_layout(config(**overrides))
    assert not layout.is_hybrid, why
    assert layout.num_tensors == layout.groups[0].layer_ids[-1] + 1


def test_turned_off_it_is_one_tensor_per_layer():
    layout = kv_group_layout(config(), hybrid=False)
    assert not layout.is_hybrid and layout.num_tensors == 48 and layout.placement(5) == (0, 5)


@pytest.mark.parametrize("chunk", [None, 0, -8])
def test_chunked_layers_without_a_positive_chunk_are_refused_by_name(chunk):
    with pytest.raises(CheckpointError, match=r"attention_chunk_size must be a positive integer .*layers \[0, 1, 2, "):
        config(attention_chunk_size=chunk)


def test_a_missing_chunk_is_transformers_default():
    raw = dict(MAVERICK)
    del raw["attention_chunk_size"]
    assert model_config_from_dict(raw).attention_chunk_size == 8192
