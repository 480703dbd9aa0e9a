"""Every engine option, defined once: name, type, default, help, and where EngineConfig keeps it.

Each front end is derived from this table, so an option reachable from one is reachable from all:
- `LLM(model, **options)`, `AsyncLLM(model, **options)` / `AsyncLLM.from_options`: engine_config();
- `warpspec generate` and `warpspec serve` flags: add_engine_flags() / engine_options_from_flags();
- the serve config and build_app args: ServeConfig reads them through parse_option();
- the documentation's option table (docs/options.md): options_table() (a test holds the page to it).

The checks on values stay with the config dataclasses (engine.py), which name the field and limit.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from warpspec.config.engine import (
    COMM_BACKENDS,
    DISPATCH_MODES,
    EXECUTORS,
    MOE_PARALLEL_MODES,
    PLACEMENT_STRATEGIES,
    SPECULATIVE_METHODS,
    SPECULATIVE_POLICIES,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.kv_cache import DEFAULT_MEMORY_GIB, CacheConfig


@dataclass(frozen=True)
class EngineOption:
    name: str
    field: str  # where EngineConfig keeps it: "dtype", or "<section>.<attribute>" ("parallel.num_workers")
    kind: type  # int, float, str, bool, or tuple (of ints, "1,2,4" as text)
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    # Model and numerics.
    EngineOption("dtype", "dtype", str, "auto", "weights and activations: the checkpoint's, or one named",
                 ("auto", "float32", "bfloat16", "float16")),
    EngineOption("max_model_len", "max_model_len", int, None,
                 "prompt + output tokens at most (default: the checkpoint's max_position_embeddings)"),
    EngineOption("quantization", "quantization", str, None,
                 "fp8: quantize linear and expert weights at load (an fbgemm_fp8 checkpoint is FP8 without it)",
                 ("fp8",)),
    EngineOption("device", "device", str, "auto", "auto (CUDA when this process sees a GPU, else CPU), cpu, cuda"),
    EngineOption("deterministic", "deterministic", bool, False,
                 "batch-invariant steps: a request's tokens depend neither on the others nor on speculation"),
    EngineOption("enforce_eager", "enforce_eager", bool, False,
                 "run every step eagerly: no CUDA graphs, no compiled CPU steps, no compiled draft "
                 "(WARPSPEC_ENFORCE_EAGER=1 makes it the default)"),
    EngineOption("cuda_graph_batch_sizes", "cuda_graph_batch_sizes", tuple, CudaGraphConfig.batch_sizes,
                 "batch sizes captured as CUDA graphs (the target's steps, the draft's greedy proposal), up to "
                 "the first that holds max_num_seqs; on a CPU, compiled steps cover every batch size (one "
                 "sequence only when max_num_seqs is 1)"),
    EngineOption("seed", "seed", int, 0, "seeds the requests that bring no seed of their own"),
    EngineOption("run_dir", "run_dir", str, "runs", "a local Ray cluster's session files and compile caches"),
    EngineOption("compile_cache", "compile_cache", str, None,
                 "the folder of compiled steps' artifacts, shared by every process that names it (default: "
                 "run_dir/inductor); on a Ray cluster a replica also fetches what another one built"),
    # KV cache.
    EngineOption("block_size", "cache.block_size", int, CacheConfig.block_size, "tokens per KV block"),
    EngineOption("num_kv_blocks", "cache.num_blocks", int, None,
                 "KV blocks per worker, each block_size tokens of every layer (default: as many as "
                 "kv_cache_memory_gib holds; a hybrid cache holds one block per KV group in the memory of each)"),
    EngineOption("kv_cache_memory_gib", "cache.memory_gib", float, DEFAULT_MEMORY_GIB,
                 "KV cache per worker, GiB (WARPSPEC_KV_CACHE_MEMORY_GIB sets the default)"),
    EngineOption("hybrid_kv_cache", "cache.hybrid", bool, CacheConfig.hybrid,
                 "chunked-attention layers (Llama 4's RoPE layers) keep only their chunk's KV"),
    # Scheduler.
    EngineOption("max_num_seqs", "scheduler.max_num_seqs", int, SchedulerConfig.max_num_seqs,
                 "sequences running together"),
    EngineOption("max_num_batched_tokens", "scheduler.max_num_batched_tokens", int,
                 SchedulerConfig.max_num_batched_tokens, "tokens per step; longer prompts prefill in chunks"),
    EngineOption("enable_prefix_caching", "scheduler.enable_prefix_caching", bool,
                 SchedulerConfig.enable_prefix_caching, "reuse the KV of prompt blocks seen before"),
    EngineOption("max_waiting_requests", "scheduler.max_waiting_requests", int, SchedulerConfig.max_waiting_requests,
                 "queued requests beyond which new ones are refused"),
    EngineOption("priority_aging_steps", "scheduler.priority_aging_steps", int, SchedulerConfig.priority_aging_steps,
                 "a request goes before requests of a priority one better that arrive this many steps after it"),
    # Parallel layout.
    EngineOption("num_workers", "parallel.num_workers", int, ParallelConfig.num_workers,
                 "ranks the model is sharded over, one GPU (or CPU process) each"),
    EngineOption("executor", "parallel.executor", str, ParallelConfig.executor,
                 "local: in this process; ray: a coordinator and worker actors; auto: ray for 2+ workers", EXECUTORS),
    EngineOption("dispatch", "parallel.dispatch", str, ParallelConfig.dispatch,
                 "per-step dispatch to the workers: a Ray Compiled Graph or plain actor calls", DISPATCH_MODES),
    EngineOption("placement_strategy", "parallel.placement_strategy", str, ParallelConfig.placement_strategy,
                 "how the workers of LLM/AsyncLLM are placed (a served replica is always one STRICT_PACK gang)",
                 PLACEMENT_STRATEGIES),
    EngineOption("placement_timeout_s", "parallel.placement_timeout_s", float, ParallelConfig.placement_timeout_s,
                 "how long to wait for the workers' resources"),
    EngineOption("core_reply_interval_ms", "parallel.core_reply_interval_ms", float,
                 ParallelConfig.core_reply_interval_ms,
                 "through Ray, the core merges a request's middle steps into one reply per this many ms "
                 "(first tokens and ends go at once; 0: a reply per step)"),
    EngineOption("comm_backend", "parallel.comm_backend", str, ParallelConfig.comm_backend,
                 "collectives between ranks: nccl on GPU; on CPU shared memory when the ranks share a host "
                 "(shm), else gloo (auto)", COMM_BACKENDS),
    EngineOption("moe_parallel", "parallel.moe_parallel", str, ParallelConfig.moe_parallel,
                 "routed experts split by width over all ranks (tensor) or whole per rank (expert)",
                 MOE_PARALLEL_MODES),
    # Speculative decoding.
    EngineOption("speculative_method", "speculative.method", str, None,
                 "the drafter: eagle3 (a draft model, default when draft is given) or ngram (prompt lookup in the "
                 "request's own text, no draft model); unset without a draft: no speculation",
                 SPECULATIVE_METHODS),
    EngineOption("draft", "speculative.draft", str, None, "an EAGLE-3 draft folder: speculative decoding"),
    EngineOption("num_speculative_tokens", "speculative.num_speculative_tokens", int,
                 SpeculativeConfig.num_speculative_tokens, "draft tokens verified per target step"),
    EngineOption("aux_layer_offset", "speculative.aux_layer_offset", int, SpeculativeConfig.aux_layer_offset,
                 "1 for drafts whose aux layer ids follow SGLang's convention"),
    EngineOption("compile_draft", "speculative.compile_draft", bool, SpeculativeConfig.compile_draft,
                 "torch.compile the draft: its dense parts, and on a CPU its single-token steps whole"),
    EngineOption("speculative_policy", "speculative.speculative_policy", str, SpeculativeConfig.speculative_policy,
                 "adaptive: each step drafts the length (0 .. num_speculative_tokens) that the measured step "
                 "costs and acceptance say yields the most tokens per second; fixed: always "
                 "num_speculative_tokens", SPECULATIVE_POLICIES),
    EngineOption("coupled_verification", "speculative.coupled_verification", bool,
                 SpeculativeConfig.coupled_verification,
                 "sampled requests verified by Gumbel-max coupling: a seeded request's tokens as without the draft"),
    EngineOption("prompt_lookup_min", "speculative.prompt_lookup_min", int, SpeculativeConfig.prompt_lookup_min,
                 "ngram: the shortest suffix of the text so far looked up in it"),
    EngineOption("prompt_lookup_max", "speculative.prompt_lookup_max", int, SpeculativeConfig.prompt_lookup_max,
                 "ngram: the longest suffix looked up (the longest match found proposes)"),
)
BY_NAME = {option.name: option for option in ENGINE_OPTIONS}
SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
            "speculative": SpeculativeConfig}


def engine_config(model: str, **options: Any) -> EngineConfig:
    """The EngineConfig for a checkpoint folder and any of ENGINE_OPTIONS, by name."""
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for name, value in options.items():
        option = BY_NAME.get(name)
        if option is None:
            raise TypeError(f"unknown engine option {name!r}; known: {', '.join(sorted(BY_NAME))}")
        section, _, attribute = option.field.rpartition(".")
        (sections[section] if section else top)[attribute] = value
    configs = {name: SECTIONS[name](**values) for name, values in sections.items()}
    return EngineConfig(model=str(model), **top, **configs)


def parse_option(name: str, raw: Any, kind: type) -> Any:
    """A value that may arrive as text (serve config args, CLI flags) in its declared kind; None for
    "", "none", "null". Refused naming the option otherwise."""
    if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "null")):
        return None
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be a boolean, got {raw!r}")
    if kind is tuple:
        items = raw.split(",") if isinstance(raw, str) else raw
        try:
            return tuple(int(item) for item in items)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be integers separated by commas, got {raw!r}") from None
    try:
        if kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {kind.__name__}, got {raw!r}") from None


def _shown(default: Any) -> str:
    """A default as a user types it: (1, 2, 4) -> "1,2,4"."""
    return ",".join(map(str, default)) if isinstance(default, tuple) else str(default)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """A --flag per engine option (--num-workers, --enable-prefix-caching / --no-enable-prefix-caching,
    ...), each defaulting to None: only the flags given reach engine_config. skip: options the command
    spells its own way."""
    group = parser.add_argument_group("engine options (any of LLM's keyword arguments)")
    for option in ENGINE_OPTIONS:
        if option.name in skip:
            continue
        text = f"{option.help} (default: {_shown(option.default)})"
        if option.kind is bool:
            group.add_argument(flag(option.name), action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag(option.name), default=None, choices=option.choices, help=text)


def engine_options_from_flags(namespace: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The engine options given on the command line (add_engine_flags with the same skip), converted
    to their kinds."""
    options = {}
    for option in ENGINE_OPTIONS:
        raw = None if option.name in skip else getattr(namespace, option.name, None)
        if raw is not None:
            options[option.name] = parse_option(option.name, raw, option.kind)
    return options


def options_table() -> str:
    """The documentation's table of engine options (docs/options.md), one row per option."""
    rows = ["| option | default | what it sets |", "|---|---|---|"]
    for option in ENGINE_OPTIONS:
        choices = f" ({' / '.join(option.choices)})" if option.choices else ""
        rows.append(f"| `{option.name}` | `{_shown(option.default)}` | {option.help}{choices} |")
    return "\n".join(rows)
