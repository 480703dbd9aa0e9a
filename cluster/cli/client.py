"""A small gRPC client for a warpspec deployment, and the `warpspec client` command.

    from warpspec.cli.client import GenerationClient

    with GenerationClient("localhost:9000") as client:
        reply = client.generate("def main():", max_tokens=32, temperature=0.0)
        reply.text, reply.finish_reason, reply.usage.completion_tokens
        for delta in client.stream("def main():", max_tokens=32):
            print(delta.text, end="")

Sampling keywords are the fields of warpspec.v1.SamplingParams (max_tokens, temperature, top_p,
top_k, min_p, seed, stop, stop_token_ids, logprobs, ignore_eos, penalties, skip_special_tokens);
left out, the server's default applies. Failures raise grpc.RpcError with the server's status code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc


def make_request(prompt: str | list[int], request_id: str = "", **params: Any) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text or token ids) and SamplingParams keywords."""
    known = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    unknown = sorted(set(params) - known)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    sampling = pb.SamplingParams(**{k: v for k, v in params.items() if v is not None})
    if isinstance(prompt, str):
        return pb.GenerateRequest(prompt=prompt, params=sampling, request_id=request_id)
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(prompt)), params=sampling, request_id=request_id)


class GenerationClient:
    def __init__(self, target: str = "localhost:9000", timeout: float | None = None,
                 metadata: list[tuple[str, str]] | None = None, api_key: str | None = None):
        """timeout: seconds per call (the gRPC deadline), None for none. metadata: sent with every call;
        with several Serve applications, include ("application", name). api_key: for a server started
        with one (sent as `authorization: Bearer <key>`)."""
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout
        self.metadata = list(metadata or []) + ([("authorization", f"Bearer {api_key}")] if api_key else [])

    def generate(self, prompt: str | list[int], request_id: str = "", **params: Any) -> pb.GenerateResponse:
        return self.stub.Generate(make_request(prompt, request_id, **params), timeout=self.timeout,
                                  metadata=self.metadata)

    def stream(self, prompt: str | list[int], request_id: str = "", **params: Any) -> Iterator[pb.GenerateResponse]:
        """Deltas; the last carries finish_reason and usage. Call .cancel() on the returned iterator
        to abort the request on the server (its KV cache is freed)."""
        return self.stub.GenerateStream(make_request(prompt, request_id, **params), timeout=self.timeout,
                                        metadata=self.metadata)

    def tokenize(self, text: str) -> pb.TokenizeResponse:
        return self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self.timeout, metadata=self.metadata)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def health(self, service: str = "") -> str:
        """"SERVING" or "NOT_SERVING" (grpc.health.v1, what Kubernetes gRPC probes call)."""
        reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout,
                                       metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---- `warpspec client` -----------------------------------------------------------------------------

# Status codes that mean the request itself was refused (bad input), not that the server failed.
REJECTED_INPUT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND}


def add_client_parser(commands: argparse._SubParsersAction) -> None:
    client = commands.add_parser("client", help="call a running `warpspec serve` over gRPC")
    client.add_argument("action", choices=["generate", "stream", "tokenize", "info", "health"])
    client.add_argument("--target", default="localhost:9000", help="host:port of the gRPC proxy")
    client.add_argument("--timeout", type=float, help="deadline in seconds")
    client.add_argument("--api-key", default=os.environ.get("WARPSPEC_API_KEY"),
                        help="the server's API key (default: $WARPSPEC_API_KEY)")
    client.add_argument("--prompt", help="prompt text (generate, stream, tokenize)")
    client.add_argument("--prompt-token-ids", help="prompt as comma-separated token ids")
    client.add_argument("--max-tokens", type=int)
    client.add_argument("--temperature", type=float, default=0.0,
                        help="0 (the default, as in `warpspec generate`) is greedy")
    client.add_argument("--top-p", type=float)
    client.add_argument("--top-k", type=int)
    client.add_argument("--seed", type=int)
    client.add_argument("--stop", action="append")
    client.add_argument("--request-id", default="")
    client.add_argument("--json", action="store_true", help="print messages as JSON")
    client.set_defaults(func=run_client_command)


def run_client_command(ns: argparse.Namespace) -> None:
    def show(message) -> None:
        print(json.dumps(MessageToDict(message, preserving_proto_field_name=True)), flush=True)

    with GenerationClient(ns.target, timeout=ns.timeout, api_key=ns.api_key) as client:
        try:
            if ns.action == "health":
                print(client.health())
            elif ns.action == "info":
                show(client.model_info())
            elif ns.action == "tokenize":
                show(client.tokenize(ns.prompt or ""))
            else:
                prompt: str | list[int] | None = ns.prompt
                if ns.prompt_token_ids:
                    try:
                        prompt = [int(t) for t in ns.prompt_token_ids.split(",")]
                    except ValueError:
                        raise ValueError(f"--prompt-token-ids must be comma-separated integers, got "
                                         f"{ns.prompt_token_ids!r:.80}") from None
                if prompt is None:
                    raise ValueError("pass --prompt or --prompt-token-ids")
                params = dict(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                              seed=ns.seed, stop=ns.stop)
                if ns.action == "generate":
                    reply = client.generate(prompt, ns.request_id, **params)
                    show(reply) if ns.json else print(reply.text)
                else:
                    for delta in client.stream(prompt, ns.request_id, **params):
                        show(delta) if ns.json else print(delta.text, end="", flush=True)
                    if not ns.json:
                        print()
        except grpc.RpcError as e:
            print(f"warpspec: error: {e.code().name}: {e.details()}", file=sys.stderr)
            # Rejected input exits 2, as everywhere in the CLI; a server that failed, 1.
            raise SystemExit(2 if e.code() in REJECTED_INPUT else 1) from None
