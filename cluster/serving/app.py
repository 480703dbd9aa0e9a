"""The Serve application builder: `warpspec.serving.app:build_app` in a Serve config file
(`serve run` / `serve deploy`, KubeRay's serveConfigV2) or via `warpspec serve`.

The gRPC servicers are cluster-wide Serve settings, not per application: the config file's
`grpc_options` must list serve_config.GRPC_SERVICER_FUNCTIONS, e.g.

    grpc_options:
      port: 9000
      grpc_servicer_functions:
        - warpspec.serving.grpc_servicers.add_GenerationServicer_to_server
        - warpspec.serving.grpc_servicers.add_HealthServicer_to_server
    applications:
      - name: warpspec
        route_prefix: /
        import_path: warpspec.serving.app:build_app
        args: {model: /models/maverick, draft: /models/maverick-eagle3, num_workers: 8}
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from warpspec.config.engine import ParallelConfig
from warpspec.config.options import engine_config
from warpspec.executor.placement import check_gang_fits, serving_bundles
from warpspec.serving.deployment import WarpspecServer
from warpspec.serving.serve_config import ServeConfig


def check_replica_fits(config: ServeConfig) -> None:
    """Before deploying on a connected Ray cluster: a replica whose gang (replica_placement) no node can
    hold fails here, naming each node's resources, instead of waiting for resources forever."""
    placement = replica_placement(config)
    if placement:
        timeout_s = config.engine.get("placement_timeout_s", ParallelConfig.placement_timeout_s)
        check_gang_fits(placement["placement_group_bundles"], timeout_s)


def resolve_device(engine: dict[str, Any]) -> dict[str, Any]:
    """device "auto" (or unset) for served replicas: cuda when the Ray cluster has GPUs, else cpu.
    Decided here, where Ray is connected: a replica's own process sees no GPU unless num_gpus gives
    it one, so "auto" resolved there would mean cpu."""
    if engine.get("device", "auto") != "auto":
        return engine
    import ray

    has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    return {**engine, "device": "cuda" if has_gpus else "cpu"}


def request_routing(config: ServeConfig) -> dict[str, Any]:
    """Serve's request router: warpspec's prefix-aware one (prefix_router.py), or Serve's default."""
    if not config.prefix_routing:
        return {}
    return {"request_router_config": RequestRouterConfig(
        request_router_class="warpspec.serving.prefix_router.PrefixAffinityRouter")}


def replica_placement(config: ServeConfig) -> dict[str, Any]:
    """Serve's placement options for a replica whose ranks run in Ray actors: the replica and its ranks
    as one STRICT_PACK gang (coordinator.serving_bundles), so Serve reserves them together, on one
    node, and spreads replicas over nodes by gang. A replica that runs its one rank itself needs none."""
    engine = engine_config(config.model, **config.engine)
    if not engine.parallel.uses_ray:
        return {}
    return {"placement_group_bundles": serving_bundles(engine, config.num_cpus, config.num_gpus),
            "placement_group_strategy": "STRICT_PACK"}


def build_app(args: dict[str, Any]) -> serve.Application:
    """Build the warpspec Serve application from flat args (strings are converted, so
    `serve run warpspec.serving.app:build_app model=/m num_workers=2` works too).

    Model and engine:
        model (required): the target checkpoint folder, readable on every node that hosts a replica.
        model_name: the name clients use (OpenAI `model`); default the folder's name.
        Every engine option, by name (warpspec.config.options.ENGINE_OPTIONS; docs/options.md's table
        lists each with its default): dtype, max_model_len, quantization, device ("auto": cuda when
        the Ray cluster has GPUs), deterministic, the KV cache (kv_cache_memory_gib per worker or
        num_kv_blocks, block_size, hybrid_kv_cache), the scheduler (max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, max_waiting_requests: beyond it RESOURCE_EXHAUSTED / 429,
        priority_aging_steps), the
        parallel layout (num_workers, one GPU each; executor; dispatch; core_reply_interval_ms;
        comm_backend; moe_parallel;
        placement_timeout_s: how long a new replica's gang may wait for a node; placement_strategy is
        accepted but a replica is always one STRICT_PACK gang), speculation (speculative_method: eagle3
        with a draft folder, or ngram with prompt_lookup_min and prompt_lookup_max; num_speculative_tokens,
        aux_layer_offset, compile_draft, coupled_verification, speculative_policy), enforce_eager,
        cuda_graph_batch_sizes, seed, run_dir, compile_cache (the compiled steps' folder).

    Replicas (Ray Serve):
        min_replicas (1), max_replicas (1), initial_replicas (min_replicas), target_ongoing_requests (8):
            the autoscaling_config; upscale_delay_s (10), downscale_delay_s (60), look_back_period_s (30).
        max_ongoing_requests (64): per replica, beyond it Serve queues the request.
        num_cpus (1), num_gpus (0): the replica actor's own resources (it runs the model itself when
            num_workers is 1 and executor is "auto"; Ray workers take theirs through a placement group).
        warmup (true): run one short request before the replica takes traffic.
        stream_interval (1): streamed messages carry at least this many new tokens; each message costs
            a few ms on the serving path, so a fast model on few CPUs streams cheaper in bunches.
        stream_gap_ms (25): after its first message a stream sends at most one message per this many ms,
            carrying all tokens since the last; a stream slower than that still sends each token at once.
        prefix_routing (true): a gRPC request whose prompt opens like an earlier one goes to the replica
            that served that one (its prefix cache), unless it is much busier (prefix_router.py).
        health_check_period_s (10). drain_timeout_s (30): on scale-down or redeploy, a stopping
            replica's requests may run this long; then Serve stops it and the proxy fails the rest.
        stall_timeout_s (60): requests in flight and no engine step for this long: the engine is stuck;
            its requests fail (UNAVAILABLE / 503) and it is rebuilt (0: never).
        min_acceptance_length (1.3): with a draft, an acceptance length below this over the last minute
            logs a warning naming draft and target and sets the warpspec_low_acceptance gauge (0: never).
        log_format ("text"): the replicas' logs, or "json": one object per line, each line about a
            request with its request_id and trace_id, and an access line per request.
        otlp_traces_endpoint: trace every request with OpenTelemetry to this OTLP/HTTP receiver (its
            /v1/traces URL); unset: only where the standard OTEL_* variables ask for traces.

    Security and limits:
        api_key: clients must send it (HTTP `Authorization: Bearer KEY`, gRPC metadata
            `authorization: Bearer KEY`); health endpoints stay open. api_key_file: read it from a file
            instead. Neither: the WARPSPEC_API_KEY environment variable where build_app runs, else none.
        max_request_bytes (16 MiB): one gRPC message or HTTP body. max_prompt_bytes (4 MiB): prompt text.
    """
    config = ServeConfig.from_args(dict(args))
    config.engine = resolve_device(config.engine)
    deployment = WarpspecServer.options(
        autoscaling_config=config.autoscaling_config,
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=config.health_check_period_s,
        graceful_shutdown_timeout_s=config.drain_timeout_s,
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        **replica_placement(config),
        **request_routing(config),
    )
    return deployment.bind(config.replica_settings())
