"""`warpspec bench serve`: the serving path (gRPC client -> Serve gRPC proxy -> replica -> AsyncLLM)
beside AsyncLLM called in-process, under the same load, in one run.

Load: `--concurrency C` keeps C streams busy (each sends its next request when the last ends), or
`--rate R` sends requests open-loop at Poisson arrivals of R per second (no cap on in flight). Same
prompts (random token ids, so no prefix-cache hits), same output lengths (ignore_eos), greedy. Per
request: TTFT from send to the first token, TPOT over the rest. Reported per path: output tokens/s
and TTFT / TPOT p50, p90, p99; and the serving overhead (tokens/s lost, TPOT added). The two paths run
interleaved over --repeats rounds (median kept): this machine's speed drifts. Writes
runs/bench/serve.json and serve.md.

`--tracing` adds two paths over the same in-process engine: the replica front (ReplicaFrontend and
the gRPC service's code, no network) without a tracer, and with one tracing every request to an
OTLP/HTTP receiver on loopback (a process of its own that accepts and drops the spans), each request
carrying a client traceparent; and the tokens/s tracing costs.

`--autoscale` runs the autoscaling check instead (benchmarks/autoscale_check.py): runs/bench/serve_autoscale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from warpspec.benchmarks.throughput import make_prompts
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.sampling_params import SamplingParams
from warpspec.serving.serve_config import ServeConfig
from warpspec.training.random_checkpoint import create_random_checkpoint

# One request under load: (time to first token, time per output token after it, output tokens, the
# inter-token latencies: for each message after the first, the time since the one before, as
# vLLM's serving benchmark counts them: tokens that arrive together wait as one).
Timing = tuple[float, float, int, list[float]]
RunOne = Callable[[list[int]], Awaitable[Timing]]
REPLICA_CPUS = 1  # the replica actor's num_cpus (build_app's default)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(run_one: RunOne, prompts: list[list[int]], concurrency: int, rate: float, seed: int) -> dict:
    """Send every prompt under the load shape; returns tokens/s and latency percentiles (ms)."""
    timings: list[Timing] = []
    start = time.perf_counter()
    if rate > 0:
        rng = random.Random(seed)
        arrivals, t = [], 0.0
        for _ in prompts:
            t += rng.expovariate(rate)
            arrivals.append(t)

        async def at(offset: float, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            timings.append(await run_one(prompt))

        await asyncio.gather(*[at(a, p) for a, p in zip(arrivals, prompts, strict=True)])
    else:
        queue = list(prompts)

        async def stream() -> None:
            while queue:
                timings.append(await run_one(queue.pop()))

        await asyncio.gather(*[stream() for _ in range(concurrency)])
    wall = time.perf_counter() - start
    ttft = [t[0] * 1e3 for t in timings]
    tpot = [t[1] * 1e3 for t in timings]
    itl = [gap * 1e3 for t in timings for gap in t[3]] or [0.0]
    row = {"tokens_per_s": sum(t[2] for t in timings) / wall, "wall_s": wall}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        for q in (0.5, 0.9, 0.99):
            row[f"{name}_p{int(q * 100)}"] = _percentile(values, q)
    return row


async def _timed(token_batches) -> Timing:
    """Time one request from the moment its stream is iterated: token_batches yields the token ids
    each message (or output) brings."""
    sent, first, last, count, gaps = time.perf_counter(), None, None, 0, []
    async for token_ids in token_batches:
        if token_ids:
            now = time.perf_counter()
            first = now if first is None else first
            if last is not None:
                gaps.append(now - last)
            last = now
        count += len(token_ids)
    end = time.perf_counter()
    return first - sent, (end - first) / max(1, count - 1), count, gaps


def in_process_runner(engine: AsyncLLM, new_tokens: int) -> RunOne:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def run_one(prompt: list[int]) -> Timing:
        return await _timed(out.new_token_ids async for out in engine.generate(prompt, params))

    return run_one


def grpc_runner(stub, new_tokens: int) -> RunOne:
    from warpspec.protos.warpspec.v1 import generation_pb2 as pb

    params = pb.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def run_one(prompt: list[int]) -> Timing:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), params=params)
        return await _timed(reply.token_ids async for reply in stub.GenerateStream(request, timeout=600))

    return run_one


def frontend_runner(frontend, new_tokens: int) -> RunOne:
    """Requests through the replica front's gRPC service code in-process, each with a traceparent."""
    from warpspec.protos.warpspec.v1 import generation_pb2 as pb
    from warpspec.serving.grpc_service import GenerationService

    service = GenerationService(frontend)
    params = pb.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def run_one(prompt: list[int]) -> Timing:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), params=params)
        metadata = [("traceparent", f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-01")]
        return await _timed(reply.token_ids async for reply in service.generate_stream(request, metadata))

    return run_one


# A receiver that takes OTLP/HTTP posts and drops them, run apart so that it costs the engine nothing.
_RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Drop(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = HTTPServer(("127.0.0.1", 0), Drop)
print(server.server_port, flush=True)
server.serve_forever()
"""


def _start_serve(model_dir: Path, engine_args: dict, stream_interval: int = 1, stream_gap_ms: float = 0.0,
                 run_dir: str = "runs") -> tuple[str, str | None]:
    """(the gRPC target, the system temp folder of Ray's session files to remove after, or None when
    they stay in the run folder)."""

    from warpspec.serving.serve_cli import free_local_port, set_serving_environment, start_serving

    set_serving_environment()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Session files under the run folder, unless its path is too long for Ray's Unix sockets: at most
    # 107 bytes, of which "/ray-XXXXXXXX/session_<date>_<time>_<pid>/sockets/plasma_store" takes ~75.
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    parent = Path(run_dir).resolve() if len(str(Path(run_dir).resolve())) <= 30 else None
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir=parent)
    from warpspec.executor.ray_env import start_local_ray

    start_local_ray(temp_dir, num_cpus=4)
    port, http_port = free_local_port(), free_local_port()
    start_serving({"model": str(model_dir), "num_cpus": REPLICA_CPUS, "stream_interval": stream_interval,
                   "stream_gap_ms": stream_gap_ms,
                   **engine_args}, grpc_port=port,
                  http_port=http_port, host="127.0.0.1")
    return f"127.0.0.1:{port}", None if parent is not None else temp_dir


def _table(rows: list[dict]) -> str:
    lines = ["| path | tokens/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['tokens_per_s']:.0f} | {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p90']:.1f} / "
                     f"{r['ttft_ms_p99']:.1f} | {r['tpot_ms_p50']:.2f} / {r['tpot_ms_p90']:.2f} / "
                     f"{r['tpot_ms_p99']:.2f} | {r['itl_ms_p50']:.2f} / {r['itl_ms_p99']:.2f} |")
    return "\n".join(lines)


def _median_row(path: str, runs: list[dict]) -> dict:
    return {"path": path, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}


async def _compare(model_dir: Path, engine_args: dict, target: str, vocab: int,
                   args: argparse.Namespace) -> dict[str, list[dict]]:
    """Both paths under the same loads, interleaved round by round."""
    import grpc

    from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc

    # Like for like: Ray starts the replica with OMP_NUM_THREADS = its num_cpus (1), so the in-process
    # engine gets as many torch threads. (Two OpenMP threads on a busy 2-core machine spin-wait for
    # each other: measured 10x slower steps here while another process ran.)
    torch.set_num_threads(REPLICA_CPUS)
    engine = AsyncLLM.from_options(str(model_dir), **engine_args)
    receiver = provider = None
    async with grpc.aio.insecure_channel(target) as channel:
        paths = {"AsyncLLM in-process": in_process_runner(engine, args.new_tokens),
                 "gRPC via Ray Serve": grpc_runner(pb_grpc.GenerationStub(channel), args.new_tokens)}
        if args.tracing:
            from warpspec.serving.replica_frontend import ReplicaFrontend
            from warpspec.tracing import TRACER_NAME, configure_tracing

            receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
            provider = configure_tracing(f"http://127.0.0.1:{receiver.stdout.readline().strip()}/v1/traces")
            paths["replica front, tracing off"] = frontend_runner(ReplicaFrontend(engine), args.new_tokens)
            paths["replica front, tracing on"] = frontend_runner(
                ReplicaFrontend(engine, tracer=provider.get_tracer(TRACER_NAME)), args.new_tokens)
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        warm = make_prompts(2, args.prompt_len, vocab, seed=999)
        for run_one in paths.values():
            await drive(run_one, warm, 2, 0.0, 0)
        try:
            for repeat in range(args.repeats):
                prompts = make_prompts(args.num_requests, args.prompt_len, vocab, seed=repeat)
                for name, run_one in paths.items():
                    runs[name].append(await drive(run_one, prompts, args.concurrency, args.rate, seed=repeat))
        finally:
            await engine.shutdown()
            if receiver is not None:
                provider.shutdown()
                receiver.kill()
                receiver.wait()
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a random 'small' checkpoint)")
    parser.add_argument("--concurrency", type=int, default=8, help="streams kept busy (closed loop)")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second (0: closed loop)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-interval", type=int, default=ServeConfig.stream_interval,
                        help="the deployment's stream_interval: new tokens per streamed message at least")
    parser.add_argument("--stream-gap-ms", type=float, default=ServeConfig.stream_gap_ms,
                        help="the deployment's stream_gap_ms: at most one streamed message per this many ms "
                             "(default: the deployment's, %(default)g)")
    parser.add_argument("--run-dir", default="runs")
    parser.add_argument("--tracing", action="store_true",
                        help="add the replica front without and with OpenTelemetry tracing of every request")
    parser.add_argument("--autoscale", action="store_true",
                        help="instead: check that sustained load adds a second replica that takes traffic, "
                             "and that the deployment scales back down")
    args = parser.parse_args(argv)

    out_dir = Path(args.run_dir, "bench")
    model_dir = Path(args.model) if args.model else out_dir / "serve-model"
    if not (model_dir / "config.json").exists():
        create_random_checkpoint(model_dir, "small")
    if args.autoscale:
        from warpspec.benchmarks.autoscale_check import run_autoscale_check

        result = run_autoscale_check(model_dir, concurrency=args.concurrency)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "serve_autoscale.json").write_text(json.dumps(result, indent=2))
        print(f"autoscaling: 2 replicas {result['scaled_up_after_s']:.1f} s into sustained load "
              f"({args.concurrency} streams); replies per replica over the next "
              f"{result['split_window_s']:g} s: {result['replies_per_replica']}; "
              f"back to 1 replica {result['scaled_down_after_s']:.1f} s after the load stopped")
        return 0
    engine_args = {"dtype": "float32", "enable_prefix_caching": False, "max_waiting_requests": 4096}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    import ray
    from ray import serve

    target, scratch = _start_serve(model_dir, engine_args, args.stream_interval, args.stream_gap_ms, args.run_dir)
    try:
        runs = asyncio.run(_compare(model_dir, engine_args, target, vocab, args))
    finally:
        serve.shutdown()
        ray.shutdown()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    rows = [_median_row(name, r) for name, r in runs.items()]
    local, served = rows[:2]
    overhead = {"tokens_per_s_lost_pct": 100 * (1 - served["tokens_per_s"] / local["tokens_per_s"]),
                "tpot_p50_added_pct": 100 * (served["tpot_ms_p50"] / local["tpot_ms_p50"] - 1),
                "ttft_p50_added_ms": served["ttft_ms_p50"] - local["ttft_ms_p50"]}
    load = f"{args.rate:g} req/s open loop" if args.rate > 0 else f"{args.concurrency} concurrent streams"
    # set_serving_environment() chose it unless the environment already had a value.
    transport = "gRPC" if os.environ.get("RAY_SERVE_PROXY_USE_GRPC") == "1" else "Ray actor calls"
    report = {"load": load, "stream_interval": args.stream_interval, "stream_gap_ms": args.stream_gap_ms,
              "proxy_to_replica": transport,
              "num_requests": args.num_requests,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows,
              "overhead": overhead}
    out_dir.mkdir(parents=True, exist_ok=True)
    tracing = ""
    if args.tracing:
        off, on = rows[2:]
        report["tracing_tokens_per_s_lost_pct"] = 100 * (1 - on["tokens_per_s"] / off["tokens_per_s"])
        tracing = (f"tracing every request: {report['tracing_tokens_per_s_lost_pct']:.1f}% fewer tokens/s than the "
                   f"same front without a tracer\n")
    (out_dir / "serve.json").write_text(json.dumps(report, indent=2))
    text = (f"Serving overhead, {load}, {args.num_requests} requests x {args.new_tokens} tokens, "
            f"stream_interval {args.stream_interval}, stream_gap_ms {args.stream_gap_ms:g}, proxy to replica over "
            f"{transport} (median of {args.repeats}):\n\n{_table(rows)}\n\n"
            f"serving path: {overhead['tokens_per_s_lost_pct']:.1f}% fewer tokens/s, "
            f"TPOT p50 {overhead['tpot_p50_added_pct']:+.1f}%, TTFT p50 {overhead['ttft_p50_added_ms']:+.1f} ms\n"
            f"{tracing}")
    (out_dir / "serve.md").write_text(text)
    print(text)
    return 0
