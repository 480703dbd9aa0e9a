"""`warpspec bench routing`: prefix-aware routing (serving/prefix_router.py) against Serve's default
power of two choices, same workload, 2 replicas, side by side in one run.

The workload: a few long openings (system prompts / few-shot headers, whole held-out prompts of the
bundled pair strung together) each followed by a short question of its own, sent in a shuffled
order over gRPC streams by a fixed number of concurrent clients. Reported per router: the share of
prompt tokens the replicas' prefix caches supplied, client-side TTFT, and the wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from warpspec.assets import BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks.report import write_report


def workload(num_openings: int, opening_prompts: int, num_requests: int, seed: int = 0) -> list[list[int]]:
    """num_requests prompts: opening i (opening_prompts held-out prompts in an order of its own, strung
    together) + a question (one more held-out prompt), shuffled; openings i and j part from their
    first prompt on."""
    prompts, rng = held_out_prompts(), random.Random(seed)
    openings = []
    for i in range(num_openings):
        order = [i % len(prompts)] + rng.sample([p for p in range(len(prompts)) if p != i % len(prompts)],
                                                opening_prompts - 1)
        openings.append([tok for p in order for tok in prompts[p][1:]])
    requests = [[1, *openings[i % num_openings], *prompts[rng.randrange(16)][1:]] for i in range(num_requests)]
    rng.shuffle(requests)
    return requests


def _stream(stub, prompt: list[int], new_tokens: int, app: str) -> dict:
    from warpspec.protos.warpspec.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                 params=pb.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    start, first, last = time.perf_counter(), None, None
    for reply in stub.GenerateStream(request, timeout=300, metadata=[("application", app)]):
        if first is None and reply.token_ids:
            first = time.perf_counter()
        last = reply
    return {"ttft_s": first - start, "cached": last.usage.cached_tokens, "prompt": last.usage.prompt_tokens}


def measure(target: str, prefix_routing: bool, prompts: list[list[int]], ports: tuple[int, int], args) -> dict:
    """ports: (gRPC, HTTP), the same for every call: Serve's proxies start once."""
    import grpc
    from ray import serve

    from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc
    from warpspec.serving.serve_cli import start_serving

    grpc_port, http_port = ports
    # An application of its own per router: a proxy keeps the router it made for a deployment's first
    # request, whatever router a redeployment of it names.
    app = "routing-prefix" if prefix_routing else "routing-pow2"
    start_serving({"model": target, "min_replicas": 2, "max_replicas": 2, "prefix_routing": prefix_routing,
                   "run_dir": args.run_dir}, grpc_port=grpc_port, http_port=http_port, app_name=app)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            progress, lock = tqdm(total=len(prompts), desc=f"prefix_routing={prefix_routing}"), threading.Lock()

            def one(prompt):
                result = _stream(stub, prompt, args.new_tokens, app)
                with lock:
                    progress.update()
                return result

            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(one, prompts))
            wall = time.perf_counter() - start
            progress.close()
    finally:
        serve.delete(app)
    ttfts = sorted(r["ttft_s"] * 1000 for r in results)
    return {"router": "prefix-aware" if prefix_routing else "power of two choices",
            "hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
            "ttft_ms_p50": statistics.median(ttfts), "ttft_ms_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "wall_s": wall}


def table(rows: list[dict]) -> str:
    lines = ["| router | prompt tokens from the prefix cache | TTFT p50 / p90 (ms) | wall (s) |", "|---|---|---|---|"]
    lines += [f"| {r['router']} | {100 * r['hit_rate']:.1f}% | {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p90']:.1f} "
              f"| {r['wall_s']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench routing", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--openings", type=int, default=16, help="distinct long openings (at most 16)")
    parser.add_argument("--opening-prompts", type=int, default=8, help="held-out prompts per opening (~30 tokens each)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Unix socket paths under the temp dir must stay short.
    from warpspec.executor.ray_env import start_local_ray

    start_local_ray(tempfile.mkdtemp(prefix="ws-route-"), num_cpus=4)
    from warpspec.serving.serve_cli import free_local_port

    prompts = workload(args.openings, args.opening_prompts, args.requests)
    ports = (free_local_port(), free_local_port())
    try:
        rows = [measure(args.target, prefix_routing, prompts, ports, args) for prefix_routing in (False, True)]
    finally:
        ray.shutdown()
    text = (f"{args.requests} requests, {args.openings} openings of ~{len(prompts[0]) - 30} tokens, "
            f"{args.concurrency} concurrent gRPC streams, {args.new_tokens} new tokens, 2 replicas\n\n{table(rows)}")
    print(text)
    write_report(args.run_dir, "routing", {"rows": rows, "args": vars(args)}, text)
    return 0
