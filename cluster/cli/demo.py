"""`warpspec demo` (and `make demo`): the whole system on the bundled model pair, in one command.

Starts a local Ray cluster, deploys the serving stack (Ray Serve: gRPC + OpenAI HTTP) on the
bundled tiny-maverick target sharded over 2 worker actors, with its EAGLE-3 draft in the
coordinator; sends several requests at once over gRPC, streams one of them to the terminal, prints
per-request figures, and stops everything it started. Its steps run eagerly unless --compile (a cold
compile takes minutes, the requests about a second); the replica's start-up phases show on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_texts


@dataclass
class RequestFigures:
    prompt: str
    completion_tokens: int
    ttft_s: float
    wall_s: float
    acceptance_length: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s


def run_request(target: str, prompt: str, max_tokens: int, echo: bool) -> RequestFigures:
    """One streamed gRPC request; echo writes its text to the terminal as it arrives."""
    from warpspec.cli.client import GenerationClient

    start = time.perf_counter()
    first = None
    final = None
    with GenerationClient(target, timeout=120) as client:
        for delta in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            if first is None and delta.token_ids:
                first = time.perf_counter() - start
            if echo:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            final = delta
    wall = time.perf_counter() - start
    return RequestFigures(prompt, final.usage.completion_tokens, first or wall, wall, final.spec.acceptance_length)


def print_table(figures: list[RequestFigures], wall_s: float) -> None:
    print("\n\n| request | prompt | tokens | TTFT (ms) | tokens/s | acceptance length |")
    print("|---|---|---|---|---|---|")
    for i, f in enumerate(figures):
        prompt = " ".join(f.prompt.split())[:40]
        print(f"| {i} | {prompt}... | {f.completion_tokens} | {f.ttft_s * 1e3:.0f} | {f.tokens_per_s:.1f} "
              f"| {f.acceptance_length:.2f} |")
    total = sum(f.completion_tokens for f in figures)
    mean_accept = sum(f.acceptance_length for f in figures) / len(figures)
    print(f"\n{len(figures)} concurrent requests: {total} tokens in {wall_s:.1f} s = {total / wall_s:.1f} tokens/s "
          f"in all; mean acceptance length {mean_accept:.2f} (k=3: at most 4.0)")


def add_demo_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="serve the bundled model pair on a local Ray cluster and stream "
                                              "requests through it")
    parser.add_argument("--model", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=6, help="concurrent requests (one is streamed)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--grpc-port", type=int, default=9000)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--run-dir", default="runs")
    parser.add_argument("--compile", action="store_true",
                        help="compile the target's steps as `warpspec serve` does: minutes the first time (then "
                             "saved under --run-dir), for requests that take about a second either way")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> None:
    prompts = held_out_texts()
    if not 1 <= args.requests <= len(prompts):
        raise ValueError(f"--requests must be in 1..{len(prompts)} (the bundled held-out prompts)")

    from warpspec.executor.ray_env import connect_ray
    from warpspec.serving.serve_cli import set_serving_environment, start_serving, stop_serving

    set_serving_environment()
    started = time.perf_counter()
    connect_ray(args.run_dir, log_to_driver=True)  # each start-up phase of the replica, as it ends
    try:
        print(f"deploying {args.model} on {args.workers} workers with the EAGLE-3 draft {args.draft} ...", flush=True)
        # Eager steps and draft unless --compile: on 2 CPU cores, with a cold compile cache, compiling
        # made the demo 140 s long instead of 17.5 s, to run its requests in 0.8 s instead of 0.9 s.
        start_serving({"model": args.model, "draft": args.draft, "num_workers": args.workers, "dtype": "float32",
                       "enforce_eager": not args.compile, "compile_draft": False, "run_dir": args.run_dir},
                      grpc_port=args.grpc_port, http_port=args.http_port, host="127.0.0.1")
        print(f"serving after {time.perf_counter() - started:.0f} s: gRPC localhost:{args.grpc_port}, OpenAI HTTP "
              f"http://127.0.0.1:{args.http_port}/v1\n", flush=True)
        target = f"localhost:{args.grpc_port}"
        chosen = prompts[: args.requests]
        print(f"streaming request 0 of {len(chosen)} (greedy, {args.max_tokens} tokens). The model is a 10M-parameter\n"
              "Llama 4 trained for an hour on 2 CPU cores: expect a few plausible words, then repetition.\n")
        print(f"[prompt] {chosen[0]}", end="", flush=True)
        print(" [model] ", end="", flush=True)
        begin = time.perf_counter()
        with ThreadPoolExecutor(len(chosen)) as pool:
            others = [pool.submit(run_request, target, p, args.max_tokens, False) for p in chosen[1:]]
            figures = [run_request(target, chosen[0], args.max_tokens, echo=True)]
            figures += [f.result() for f in others]
        print_table(figures, time.perf_counter() - begin)
    finally:
        stop_serving()
    print(f"\ndone in {time.perf_counter() - started:.0f} s; the local Ray cluster is stopped")
