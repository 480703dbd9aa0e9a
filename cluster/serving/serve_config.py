"""ServeConfig: the Ray Serve settings of a warpspec deployment, kept apart from the engine's own
settings (which it carries through to AsyncLLM unchanged), and read from the flat `args` of a Serve
config file or `warpspec serve`.

Values may arrive as strings (`serve run warpspec.serving.app:build_app model=/m num_workers=2`), so
each is converted to its declared type; an unknown name or a bad value is refused naming the arg.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from warpspec.config.options import BY_NAME as ENGINE_OPTIONS
from warpspec.config.options import engine_config, parse_option
from warpspec.serving.auth import ApiKeyAuth, resolve_api_key
from warpspec.serving.limits import MIB, RequestLimits
from warpspec.serving.logs import LOG_FORMATS

GRPC_SERVICER_FUNCTIONS = [
    # The generated servicer's handlers, with parsing that turns malformed bytes into INVALID_ARGUMENT.
    "warpspec.serving.grpc_servicers.add_GenerationServicer_to_server",
    # The standard health service, answered by the replica's Check method (Kubernetes gRPC probes),
    # and NOT_SERVING by the proxy while no replica has started.
    "warpspec.serving.grpc_servicers.add_HealthServicer_to_server",
]
DEFAULT_APP_NAME = "warpspec"


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica is built with: ServeConfig.replica_settings, its defaults' one definition.
    Serve stores it with the deployment, so it holds the API key's digest, never the key."""
    model: str
    engine: dict[str, Any]
    model_name: str | None
    warmup: bool
    stream_interval: int
    stream_gap_ms: float
    drain_timeout_s: float
    stall_timeout_s: float
    min_acceptance_length: float
    otlp_traces_endpoint: str | None
    log_format: str
    limits: RequestLimits
    auth: ApiKeyAuth | None


@dataclass
class ServeConfig:
    model: str
    model_name: str | None = None  # the OpenAI `model` name; default: the checkpoint folder's name
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    # Autoscaling keeps each replica's ongoing requests near this; max_ongoing_requests caps them
    # (beyond it Serve queues at the proxy, then answers RESOURCE_EXHAUSTED / 503).
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 64
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float | None = None  # window of the load average; None: Serve's default (30 s)
    metrics_interval_s: float | None = None  # how often load is reported; None: Serve's default (10 s)
    num_cpus: float = 1.0  # the replica actor itself (with num_workers=1 and executor=auto it runs the model)
    num_gpus: float = 0.0  # likewise; Ray workers take their own GPUs through the placement group
    warmup: bool = True  # one short request before the replica takes traffic (and compiles the draft)
    stream_interval: int = 1  # new tokens per streamed message at least (1: every step's tokens at once)
    stream_gap_ms: float = 25.0  # at most one streamed message per this many ms after the first (0: no gap)
    health_check_period_s: float = 10.0
    # Route a prompt to the replica that served its opening before (prefix_router.py); False: Serve's
    # power of two choices.
    prefix_routing: bool = True
    # Scale-down / redeploy: how long a stopping replica's requests may run on; then Serve stops it
    # (the proxy fails what is left) and its actors and placement group are released.
    drain_timeout_s: float = 30.0
    # Requests in flight and no engine step for this long: the engine is stuck (a hung collective, a
    # stopped process); its requests fail UNAVAILABLE / 503 and it is rebuilt (ReplicaFrontend
    # .check_progress). 0: never.
    stall_timeout_s: float = 60.0
    # With a draft: below this acceptance length over the last minute the replica warns (a log line
    # naming draft and target, the warpspec_low_acceptance gauge); 0: never. A draft that matches its
    # target accepts 2.4-3.2 at k = 3; one that does not, about 1.0.
    min_acceptance_length: float = 1.3
    # Trace every request with OpenTelemetry to this OTLP/HTTP receiver (its /v1/traces URL); None: only
    # where the standard OTEL_* variables ask for traces (warpspec/tracing.py).
    otlp_traces_endpoint: str | None = None
    # The replicas' logs: "text", or "json" (one object per line, for a log pipeline); serving/logs.py.
    log_format: str = "text"
    # Clients must send this key (HTTP `Authorization: Bearer`, gRPC `authorization` metadata); None:
    # api_key_file, else the WARPSPEC_API_KEY environment variable, else no key is required.
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    max_request_bytes: int = 16 * MIB  # one gRPC message / HTTP body (limits.py)
    max_prompt_bytes: int = 4 * MIB  # prompt text, UTF-8
    engine: dict[str, Any] = field(default_factory=dict)  # engine options (config/options.py) for AsyncLLM

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required: a checkpoint folder")
        if self.min_replicas < 0 or self.max_replicas < 1 or self.min_replicas > self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"min_replicas={self.min_replicas} max_replicas={self.max_replicas}")
        if self.target_ongoing_requests <= 0 or self.max_ongoing_requests < 1:
            raise ValueError(f"target_ongoing_requests must be > 0 and max_ongoing_requests >= 1, got "
                             f"{self.target_ongoing_requests} and {self.max_ongoing_requests}")
        if not self.stream_gap_ms >= 0:
            raise ValueError(f"stream_gap_ms must be >= 0, got {self.stream_gap_ms}")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0 seconds, got {self.drain_timeout_s}")
        if not self.stall_timeout_s >= 0:
            raise ValueError(f"stall_timeout_s must be >= 0 seconds (0: no watchdog), got {self.stall_timeout_s}")
        if not (self.min_acceptance_length == 0 or self.min_acceptance_length >= 1):
            raise ValueError(f"min_acceptance_length must be 0 (no warning) or >= 1 (an acceptance length "
                             f"counts the bonus token), got {self.min_acceptance_length}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL (OTLP over HTTP), got "
                             f"{self.otlp_traces_endpoint!r:.200}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r:.80}")
        engine_config(self.model, **self.engine)  # a bad engine option is refused here, named, before Ray
        self.limits = RequestLimits(self.max_request_bytes, self.max_prompt_bytes)
        key = resolve_api_key(self.api_key, self.api_key_file)
        # Only the key's digest leaves this process (the deployment's args are stored by Serve).
        self.auth = ApiKeyAuth.from_key(key) if key is not None else None

    def replica_settings(self) -> ReplicaSettings:
        return ReplicaSettings(self.model, self.engine, self.model_name, self.warmup, self.stream_interval,
                               self.stream_gap_ms, self.drain_timeout_s, self.stall_timeout_s,
                               self.min_acceptance_length, self.otlp_traces_endpoint, self.log_format,
                               self.limits, self.auth)

    @property
    def autoscaling_config(self) -> dict[str, Any]:
        config = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                  "target_ongoing_requests": self.target_ongoing_requests,
                  "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        for name in ("look_back_period_s", "metrics_interval_s"):
            if getattr(self, name) is not None:
                config[name] = getattr(self, name)
        return config

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ServeConfig:
        own = {f.name: f for f in fields(cls) if f.name != "engine"}
        values: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        for name, raw in args.items():
            if name in ENGINE_OPTIONS:
                value = parse_option(name, raw, ENGINE_OPTIONS[name].kind)
                if value is not None:
                    engine[name] = value
            elif name in own:
                kind = {"str": str, "str | None": str, "int": int, "int | None": int, "float": float,
                        "float | None": float, "bool": bool}[str(own[name].type)]
                values[name] = parse_option(name, raw, kind)
            else:
                known = sorted(set(own) | set(ENGINE_OPTIONS))
                raise ValueError(f"unknown arg {name!r}; known args: {', '.join(known)}")
        return cls(**values, engine=engine)
