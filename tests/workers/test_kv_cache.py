"""The KV cache's size (workers/kv_cache.py): 1 GiB per rank unless the engine option or, as its
default, WARPSPEC_KV_CACHE_MEMORY_GIB says otherwise; a value the variable cannot mean is refused
naming it and the limit."""

from __future__ import annotations

import pytest
import torch

from warpspec.config.options import engine_config
from warpspec.workers.kv_cache import MEMORY_ENV, CacheConfig
from warpspec.workers.models.registry import model_config_from_dict


def test_the_default_is_one_gib_unless_the_environment_names_another(monkeypatch):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    assert CacheConfig().memory_gib == 1.0
    assert engine_config("unused").cache.memory_gib == 1.0
    monkeypatch.setenv(MEMORY_ENV, "0.25")
    assert engine_config("unused").cache.memory_gib == 0.25
    assert engine_config("unused", kv_cache_memory_gib=2.0).cache.memory_gib == 2.0  # the option wins


def test_the_blocks_follow_the_memory(monkeypatch):
    config = model_config_from_dict({"architectures": ["Llama4ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 32})
    monkeypatch.setenv(MEMORY_ENV, "0.125")
    small = CacheConfig().resolve_num_blocks(config, 1, torch.float32)
    monkeypatch.setenv(MEMORY_ENV, "1")
    assert CacheConfig().resolve_num_blocks(config, 1, torch.float32) == 8 * small


@pytest.mark.parametrize("raw", ["lots", "", "0", "-1", "nan", "inf"])
def test_a_value_that_is_no_positive_size_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(MEMORY_ENV, raw)
    with pytest.raises(ValueError, match=f"WARPSPEC_KV_CACHE_MEMORY_GIB must be a positive number of GiB, got '{raw}'"):
        CacheConfig()
