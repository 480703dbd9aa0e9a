"""One definition of every engine option (config/options.py) reaches every front end: LLM and
AsyncLLM keyword arguments, `warpspec generate` and `warpspec serve` flags, serve config args and
build_app's docstring, and the documentation's option table (docs/options.md). A test here fails when
an option is reachable from one front end but not another."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from warpspec.cli.main import build_parser
from warpspec.config.engine import EngineConfig
from warpspec.config.options import ENGINE_OPTIONS, engine_config, engine_options_from_flags, flag, options_table
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.serving.app import build_app
from warpspec.serving.serve_config import ServeConfig

OPTIONS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "options.md"

# A value other than the default for every option, valid on its own.
SAMPLE = {"dtype": "bfloat16", "max_model_len": 64, "quantization": "fp8", "device": "cpu", "deterministic": True,
          "enforce_eager": True, "cuda_graph_batch_sizes": (1, 3), "seed": 7, "run_dir": "elsewhere",
          "compile_cache": "shared",
          "block_size": 32, "num_kv_blocks": 9, "kv_cache_memory_gib": 2.5, "hybrid_kv_cache": False,
          "max_num_seqs": 5,
          "max_num_batched_tokens": 99, "enable_prefix_caching": False, "max_waiting_requests": 11,
          "priority_aging_steps": 13,
          "num_workers": 3, "executor": "ray", "dispatch": "actor", "placement_strategy": "SPREAD",
          "placement_timeout_s": 4.5, "core_reply_interval_ms": 0.0, "comm_backend": "gloo",
          "moe_parallel": "expert", "draft": "d", "num_speculative_tokens": 5, "aux_layer_offset": 1,
          "compile_draft": False, "coupled_verification": True,
          "speculative_policy": "fixed", "speculative_method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _field(config: EngineConfig, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _as_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def test_every_option_has_a_sample_and_reaches_its_field():
    assert set(SAMPLE) == {o.name for o in ENGINE_OPTIONS}
    for option in ENGINE_OPTIONS:
        assert SAMPLE[option.name] != option.default, option.name
        config = engine_config("ckpt", **{option.name: SAMPLE[option.name]})
        assert _field(config, option.field) == SAMPLE[option.name], option.name


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_option_is_a_flag_of_the_command(command):
    parser = build_parser()
    for option in ENGINE_OPTIONS:
        if command == "generate" and option.name == "seed":
            continue  # generate runs one request, whose own --seed it takes
        value = SAMPLE[option.name]
        argv = [command, "--model", "m"]
        if option.kind is bool:
            argv.append(flag(option.name) if value else "--no-" + flag(option.name)[2:])
        else:
            argv += [flag(option.name), _as_text(value)]
        namespace = parser.parse_args(argv)
        skip = ("seed",) if command == "generate" else ()
        assert engine_options_from_flags(namespace, skip=skip) == {option.name: value}, option.name


def test_every_option_is_a_serve_arg_and_in_build_apps_docstring():
    for option in ENGINE_OPTIONS:
        config = ServeConfig.from_args({"model": "m", option.name: _as_text(SAMPLE[option.name])})
        assert config.engine == {option.name: SAMPLE[option.name]}, option.name
        assert option.name in build_app.__doc__, option.name


def test_the_documented_table_is_the_options_table():
    assert options_table() in OPTIONS_PAGE.read_text()


def test_llm_and_async_llm_take_options_by_name_alike():
    with pytest.raises(TypeError, match="unknown engine option 'num_worker'"):
        AsyncLLM("ckpt", num_worker=2)
    with pytest.raises(ValueError, match="num_workers must be a positive integer"):
        AsyncLLM("ckpt", num_workers=0)  # checked before anything loads, as LLM checks it
    with pytest.raises(TypeError, match="takes no options"):
        AsyncLLM(engine_config("ckpt"), dtype="float32")


def test_a_negative_reply_interval_names_the_option():
    with pytest.raises(ValueError, match="core_reply_interval_ms must be 0 or more, got -1"):
        engine_config("ckpt", core_reply_interval_ms=-1)


def test_device_auto_is_cuda_only_where_a_gpu_is_seen():
    assert engine_config("ckpt").device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_bad_flag_value_names_the_option():
    namespace = argparse.Namespace(**{o.name: None for o in ENGINE_OPTIONS} | {"num_workers": "two"})
    with pytest.raises(ValueError, match="num_workers must be int, got 'two'"):
        engine_options_from_flags(namespace)


@pytest.mark.parametrize("option,value,text,message", [
    ("device", "gpu", "gpu", "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("cuda_graph_batch_sizes", (0, 2), "0,2", "cuda_graph_batch_sizes must be positive integers"),
    ("cuda_graph_batch_sizes", (), "x", "cuda_graph_batch_sizes must be"),
    ("executor", "threads", "threads", "executor must be one of auto, local, ray, got 'threads'"),
    ("speculative_method", "medusa", "medusa", "speculative_method must be one of eagle3, ngram .*got 'medusa'"),
    ("prompt_lookup_min", 6, "6", r"prompt_lookup_min must be at most prompt_lookup_max \(5\), got 6"),
    ("prompt_lookup_max", 0, "0", "prompt_lookup_max must be a positive integer, got 0"),
])
def test_bad_values_are_refused_naming_the_option(option, value, text, message):
    """From Python, and as a serve arg (before `warpspec serve` touches Ray)."""
    with pytest.raises(ValueError, match=message):
        engine_config("ckpt", **{option: value})
    with pytest.raises(ValueError, match=message):
        ServeConfig.from_args({"model": "m", option: text})
