"""`warpspec serve`: run the application on the Ray cluster named by RAY_ADDRESS, or on a local one,
with Serve's gRPC proxy (warpspec.v1.Generation + grpc.health.v1.Health, with reflection) and HTTP
proxy (the OpenAI API), until interrupted.

Safe by default: HTTP binds 127.0.0.1 unless --host says otherwise, a local Ray cluster runs no
dashboard unless --dashboard, and --api-key / --api-key-file / WARPSPEC_API_KEY turn on API keys.
Serve's gRPC proxy always listens on every address (it takes no host), so a gRPC port reachable from
outside needs an API key or a firewall; serving without a key says so on startup.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import threading
from typing import Any

from warpspec.config.options import add_engine_flags, engine_options_from_flags
from warpspec.serving.auth import API_KEY_ENV
from warpspec.serving.serve_config import DEFAULT_APP_NAME, GRPC_SERVICER_FUNCTIONS

# What the processes of a Ray cluster that serves warpspec read from their environment. Set before
# Ray starts (a local cluster's raylet hands it to every worker); a cluster started apart (ray start,
# KubeRay) needs them in its own environment (the Dockerfile sets them).
SERVE_ENVIRONMENT = {
    # Serve's proxies reach replicas over gRPC instead of Ray actor calls: each streamed message and
    # each request cost the proxy and the replica less CPU (bench serve, 8 streams: docs/serving.md).
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    # That channel's own message limit (4 MiB by default) would refuse requests the front ends accept
    # (max_request_bytes) and large replies (many echoed prompts with logprobs); the public proxies
    # and the replica's own checks bound what comes in.
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
}


def set_serving_environment(max_request_bytes: int | None = None) -> None:
    """SERVE_ENVIRONMENT and, for the public gRPC proxy, its message limit (so that it refuses an
    oversized message itself, before it is copied to a replica), unless already set."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for name, value in SERVE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if max_request_bytes is not None:
        os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(max_request_bytes))


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a local deployment's proxies (tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serving(args: dict[str, Any], grpc_port: int = 9000, http_port: int = 8000, host: str = "127.0.0.1",
                  app_name: str = DEFAULT_APP_NAME, proxy_location: str = "EveryNode") -> None:
    """Start Serve's proxies on this Ray cluster (ray.init must have run) and deploy the app; returns
    once every replica has loaded its model and warmed up. A replica gang that no node can hold fails
    first (PlacementError, app.check_replica_fits). proxy_location "HeadOnly" keeps one proxy where
    several simulated nodes share one machine's ports (ray.cluster_utils.Cluster)."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from warpspec.serving.app import build_app, check_replica_fits
    from warpspec.serving.serve_config import ServeConfig

    check_replica_fits(ServeConfig.from_args(dict(args)))
    serve.start(proxy_location=proxy_location, http_options=HTTPOptions(host=host, port=http_port),
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    # serve.run starts Serve again, finds the instance just started and says that "new
    # http_options will not be applied": true of its own (absent) options, alarming to read here.
    serve_logger = logging.getLogger("ray.serve")
    reconnecting = _DropMessages("Connecting to existing Serve app")
    serve_logger.addFilter(reconnecting)
    try:
        serve.run(build_app(args), name=app_name, route_prefix="/")
    finally:
        serve_logger.removeFilter(reconnecting)


def stop_serving(app_name: str = DEFAULT_APP_NAME) -> None:
    """Undo start_serving. On a cluster named by RAY_ADDRESS only this application is deleted (other
    applications on it keep running). On the local cluster this process started, stopping Ray stops
    Serve with it: Serve's own shutdown kills its controller while that controller's shutdown task is
    still running, which Ray reports as a failed task ("graceful_shutdown failed ... killed by
    ray.kill") on every stop."""
    import ray
    from ray import serve

    if os.environ.get("RAY_ADDRESS"):
        serve.delete(app_name)
    ray.shutdown()


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve a checkpoint over gRPC and OpenAI HTTP on Ray Serve")
    serve.add_argument("--model", required=True, help="target checkpoint folder")
    serve.add_argument("--model-name", help="name clients use (default: the folder's name)")
    serve.add_argument("--workers", type=int, help="ranks per replica, one GPU each (= --num-workers)")
    serve.add_argument("--grpc-port", type=int, default=9000)
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1",
                       help="HTTP bind address (default 127.0.0.1: this machine only; 0.0.0.0: every address). "
                            "Serve's gRPC proxy binds every address whatever this says")
    serve.add_argument("--api-key", help=f"require this key from clients (default: ${API_KEY_ENV}, if set)")
    serve.add_argument("--api-key-file", help="require the key in this file")
    serve.add_argument("--max-request-bytes", type=int, help="largest gRPC message / HTTP body (16 MiB)")
    serve.add_argument("--max-prompt-bytes", type=int, help="largest prompt text, UTF-8 (4 MiB)")
    serve.add_argument("--dashboard", action="store_true",
                       help="run Ray's dashboard (local cluster only; off by default)")
    serve.add_argument("--min-replicas", type=int, default=1)
    serve.add_argument("--max-replicas", type=int, default=1)
    serve.add_argument("--target-ongoing-requests", type=float, default=8.0)
    serve.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                       help="any other build_app arg (repeatable), e.g. --arg drain_timeout_s=60")
    add_engine_flags(serve)
    serve.set_defaults(func=run_serve_command)


def run_serve_command(ns: argparse.Namespace) -> None:

    from warpspec.executor.ray_env import connect_ray

    args: dict[str, Any] = {"model": ns.model, "model_name": ns.model_name, "num_workers": ns.workers,
                            "min_replicas": ns.min_replicas, "max_replicas": ns.max_replicas,
                            "target_ongoing_requests": ns.target_ongoing_requests, "api_key": ns.api_key,
                            "api_key_file": ns.api_key_file, "max_request_bytes": ns.max_request_bytes,
                            "max_prompt_bytes": ns.max_prompt_bytes}
    args.update({name: value for name, value in engine_options_from_flags(ns).items()
                 if not (name == "num_workers" and ns.workers is not None)})
    for item in ns.arg:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--arg takes NAME=VALUE, got {item!r}")
        args[name] = value
    args = {k: v for k, v in args.items() if v is not None}
    from warpspec.serving.serve_config import ServeConfig

    config = ServeConfig.from_args(args)  # refuse bad args before any cluster is touched
    set_serving_environment(config.max_request_bytes)
    # The replicas' output here, as `serve run` shows it: each start-up phase as it ends, access lines.
    connect_ray(args.get("run_dir", "runs"), include_dashboard=ns.dashboard, log_to_driver=True)
    if config.auth is None:
        print(f"warpspec: no API key set (--api-key, --api-key-file or ${API_KEY_ENV}): anyone who reaches "
              f"port {ns.grpc_port} (gRPC listens on every address) or {ns.host}:{ns.http_port} can use it",
              flush=True)
    try:
        start_serving(args, grpc_port=ns.grpc_port, http_port=ns.http_port, host=ns.host)
        print(f"warpspec: serving {ns.model}: gRPC on port {ns.grpc_port}, OpenAI HTTP on "
              f"http://{ns.host}:{ns.http_port}/v1 (Ctrl-C stops)", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
        print("warpspec: stopping", flush=True)
    finally:
        stop_serving()
    where = "the application is deleted" if os.environ.get("RAY_ADDRESS") else "the local Ray cluster is down"
    print(f"warpspec: stopped ({where})", flush=True)
