"""`warpspec bench load`: a load test over gRPC against a local deployment, and what must hold after it.

Load: N concurrent streaming clients (default 64) share M requests per round (default 500) of mixed
kinds and lengths: most run to completion (ignore_eos, so each must get exactly max_tokens tokens),
some are cancelled by the client mid-stream, some carry a 1 ms deadline, some have bad parameters
(each with the status and message fragment it must get). Three identical rounds by default.

Checked after every round, and reported: every request got the right number of tokens or the
expected status; no KV block leaked (free == total once idle); the replica is healthy. After all
rounds: as many Ray actors and placement groups as right after deployment (no orphans); memory
(RSS of the replica, its coordinator and workers) grew less than 5% between the last two rounds.
Determinism: greedy outputs of fixed prompts are identical alone and amid the load, without and with
speculation (the bundled pair). TTFT / TPOT percentiles of the completed requests.

Priorities (--priorities 0,1,2): a deployment whose batch is small (--priority-max-num-seqs) so that
requests queue, and two rounds of the same requests on it: every priority equal, then each request
in a class drawn from the list. TTFT p50 / p99 and the worst TTFT per class, side by side.

Meanwhile Ray's Prometheus endpoint is read every 2 s and the Grafana dashboard's main panels are drawn
from it (benchmarks/metrics_sampler.py). Writes runs/bench/load.json, load.md and load_dashboard.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from warpspec.benchmarks.metrics_sampler import MetricsSampler, plot
from warpspec.protos.warpspec.v1 import generation_pb2 as pb
from warpspec.protos.warpspec.v1 import generation_pb2_grpc as pb_grpc
from warpspec.serving.serve_cli import free_local_port

# Kinds of request in the mix, with their share.
MIX = {"complete": 0.70, "cancel": 0.10, "deadline": 0.10, "bad": 0.10}
PROMPT_LENS = (4, 16, 48, 120)
# Bad parameters and what the replica must answer: (params, field the message names).
BAD_PARAMS = [({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -5}, "top_k"),
              ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"max_tokens": 10**6}, "max")]
MAX_RSS_GROWTH = 0.05


@dataclass(frozen=True)
class LoadSpec:
    num_clients: int = 64
    num_requests: int = 500
    max_new_tokens: int = 48
    vocab_size: int = 8192
    seed: int = 0


@dataclass
class Result:
    kind: str
    expected: str  # what must happen: "N tokens", a status code name
    ok: bool
    status: str
    num_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    detail: str = ""
    request_id: str = ""


@dataclass
class Round:
    results: list[Result]
    wall_s: float
    stats_after: dict = field(default_factory=dict)

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]


def make_requests(spec: LoadSpec, seed: int, priorities: list[int] | None = None
                  ) -> list[tuple[str, pb.GenerateRequest, int]]:
    """(kind, request, cancel_after) for one round; the same seed gives the same round. priorities:
    the i-th request's priority (unset without)."""
    rng = random.Random(seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=spec.num_requests)
    requests = []
    for i, kind in enumerate(kinds):
        prompt = [rng.randrange(3, spec.vocab_size) for _ in range(rng.choice(PROMPT_LENS))]
        params = {"max_tokens": rng.randint(1, spec.max_new_tokens), "temperature": 0.0, "ignore_eos": True}
        cancel_after = 0
        if kind == "cancel":
            params["max_tokens"], cancel_after = spec.max_new_tokens * 4, rng.randint(1, 4)
        elif kind == "bad":
            params.update(BAD_PARAMS[i % len(BAD_PARAMS)][0])
        if priorities is not None:
            params["priority"] = priorities[i]
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), params=pb.SamplingParams(**params),
                                     request_id=f"load-{seed}-{i}")
        requests.append((kind, request, cancel_after))
    return requests


async def _one(stub, kind: str, request: pb.GenerateRequest, cancel_after: int, metadata) -> Result:
    max_tokens = request.params.max_tokens
    expected = {"complete": f"{max_tokens} tokens", "cancel": "CANCELLED", "deadline": "DEADLINE_EXCEEDED",
                "bad": "INVALID_ARGUMENT"}[kind]
    timeout = 0.001 if kind == "deadline" else 300
    call = stub.GenerateStream(request, timeout=timeout, metadata=metadata)
    sent, first, count, usage = time.perf_counter(), None, 0, None
    try:
        async for reply in call:
            if reply.token_ids and first is None:
                first = time.perf_counter()
            count += len(reply.token_ids)
            if reply.finish_reason:
                usage = reply.usage.completion_tokens
            if kind == "cancel" and count >= cancel_after:
                call.cancel()
                break
    except grpc.aio.AioRpcError as e:
        status, detail = e.code().name, e.details() or ""
    else:
        status, detail = ("CANCELLED" if kind == "cancel" and usage is None else "OK"), ""
    end = time.perf_counter()
    if kind == "complete":
        ok = status == "OK" and count == max_tokens and usage == max_tokens
    elif kind == "bad":
        fragment = BAD_PARAMS[int(request.request_id.rsplit("-", 1)[1]) % len(BAD_PARAMS)][1]
        ok = status == "INVALID_ARGUMENT" and fragment in detail
    else:
        ok = status == expected
    result = Result(kind, expected, ok, status, count, detail=detail[:200], request_id=request.request_id)
    if kind == "complete" and first is not None:
        result.ttft_s, result.tpot_s = first - sent, (end - first) / max(1, count - 1)
    return result


async def run_round(target: str, spec: LoadSpec, seed: int, metadata=(), extra=None,
                    priorities: list[int] | None = None) -> Round:
    """One round of the load from spec.num_clients concurrent clients. extra: a coroutine run
    alongside (the determinism prompts), awaited before returning."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        queue = make_requests(spec, seed, priorities)
        queue.reverse()
        results: list[Result] = []

        async def client() -> None:
            while queue:
                kind, request, cancel_after = queue.pop()
                results.append(await _one(stub, kind, request, cancel_after, list(metadata)))

        start = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(spec.num_clients)], *([extra] if extra else []))
        return Round(results, time.perf_counter() - start)


async def greedy_outputs(target: str, prompts: list[list[int]], max_tokens: int, metadata=(),
                         delay_s: float = 0.0) -> list[list[int]]:
    """Greedy token ids of each prompt, sent together after delay_s (amid a load, when one runs)."""
    await asyncio.sleep(delay_s)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        async def one(prompt: list[int]) -> list[int]:
            request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), params=params)
            return list((await stub.Generate(request, timeout=300, metadata=list(metadata))).token_ids)

        return list(await asyncio.gather(*[one(p) for p in prompts]))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def latency_row(name: str, rounds: list[Round]) -> dict:
    done = [r for rnd in rounds for r in rnd.results if r.ttft_s is not None]
    ttft, tpot = [r.ttft_s * 1e3 for r in done], [r.tpot_s * 1e3 for r in done if r.num_tokens > 1]
    tokens = sum(r.num_tokens for rnd in rounds for r in rnd.results)
    return {"name": name, "num_completed": len(done), "tokens_per_s": tokens / sum(r.wall_s for r in rounds),
            "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p99": percentile(ttft, 0.99),
            "tpot_ms_p50": percentile(tpot, 0.5), "tpot_ms_p99": percentile(tpot, 0.99)}


def priority_classes(spec: LoadSpec, seed: int, choices: list[int]) -> list[int]:
    """The class of each request of a round, drawn apart from the requests themselves."""
    rng = random.Random(f"priorities-{seed}")
    return [rng.choice(choices) for _ in range(spec.num_requests)]


def priority_rows(equal: Round, mixed: Round, classes: list[int]) -> list[dict]:
    """TTFT per class: the same requests with every priority equal, then in their classes."""
    rows = []
    for cls in sorted(set(classes)):
        row = {"priority": cls}
        for name, rnd in (("equal", equal), ("mixed", mixed)):
            ttft = [r.ttft_s * 1e3 for r in rnd.results
                    if r.ttft_s is not None and classes[int(r.request_id.rsplit("-", 1)[1])] == cls]
            row |= {f"{name}_completed": len(ttft), f"{name}_ttft_ms_p50": percentile(ttft, 0.5),
                    f"{name}_ttft_ms_p99": percentile(ttft, 0.99),
                    f"{name}_ttft_ms_max": max(ttft, default=float("nan"))}
        rows.append(row)
    return rows


def priority_table(rows: list[dict]) -> str:
    lines = ["| priority | requests | TTFT p50 equal / mixed (ms) | TTFT p99 equal / mixed (ms) | worst TTFT equal / "
             "mixed (ms) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['priority']} | {r['mixed_completed']} | {r['equal_ttft_ms_p50']:.0f} / "
                     f"{r['mixed_ttft_ms_p50']:.0f} | {r['equal_ttft_ms_p99']:.0f} / {r['mixed_ttft_ms_p99']:.0f} | "
                     f"{r['equal_ttft_ms_max']:.0f} / {r['mixed_ttft_ms_max']:.0f} |")
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| deployment | completed | tokens/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['num_completed']} | {r['tokens_per_s']:.0f} | {r['ttft_ms_p50']:.1f} / "
                     f"{r['ttft_ms_p99']:.1f} | {r['tpot_ms_p50']:.2f} / {r['tpot_ms_p99']:.2f} |")
    return "\n".join(lines)


# ---- the local deployment -----------------------------------------------------------------------


def alive_actors() -> int:
    from warpspec.executor.ray_env import live_actors

    return len(live_actors())


def live_placement_groups() -> int:
    import ray

    return sum(1 for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED")


def wait_idle(handle, timeout_s: float = 30.0) -> dict:
    """The replica's stats once nothing is in flight; raises if KV blocks stay taken (a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = asdict(handle.stats.remote().result())
        idle = stats["num_in_flight"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the replica did not return to idle with every KV block free: {stats}")
        time.sleep(0.1)


def replica_rss(handle) -> dict[str, int]:
    """Bytes resident in the replica process, its coordinator and each worker."""
    import psutil

    procs = handle.processes.remote().result()
    pids = {"replica": procs.pid, **({"coordinator": procs.coordinator_pid} if procs.coordinator_pid else {}),
            **{f"worker{rank}": pid for rank, pid in enumerate(procs.worker_pids)}}
    return {name: psutil.Process(pid).memory_info().rss for name, pid in pids.items()}


def deploy(name: str, model: str, engine_args: dict, stream_interval: int):
    from ray import serve

    from warpspec.serving.deployment import WarpspecServer
    from warpspec.serving.serve_config import ServeConfig

    # Every step's tokens streamed at once (no stream gap), and a short drain: what this benchmark has
    # always measured with.
    config = ServeConfig(model, engine=engine_args, stream_interval=stream_interval, stream_gap_ms=0.0,
                         drain_timeout_s=5.0)
    app = WarpspecServer.options(name=f"{name}-server", ray_actor_options={"num_cpus": 1},
                                 max_ongoing_requests=1024)
    return serve.run(app.bind(config.replica_settings()), name=name, route_prefix=f"/{name}")


def run_deployment(name: str, target: str, model: str, engine_args: dict, args: argparse.Namespace,
                   prompts: list[list[int]], num_rounds: int) -> dict:
    """Deploy, run the rounds (the determinism prompts amid the last), check, delete; the report part."""
    from ray import serve

    actors_before, groups_before = alive_actors(), live_placement_groups()
    handle = deploy(name, model, engine_args, args.stream_interval)
    metadata = [("application", name)]
    actors_deployed, groups_deployed = alive_actors(), live_placement_groups()
    spec = LoadSpec(args.clients, args.requests, args.max_new_tokens,
                    json.loads(Path(model, "config.json").read_text())["vocab_size"], args.seed)
    alone = asyncio.run(greedy_outputs(target, prompts, args.determinism_tokens, metadata))
    rounds, rss, amid = [], [], None
    for index in range(num_rounds):
        extra = None
        if index == 0:  # rounds after the first stay identical, for the memory comparison
            async def amid_load() -> list[list[int]]:
                return await greedy_outputs(target, prompts, args.determinism_tokens, metadata, delay_s=1.0)

            extra = amid_load()
        rnd = asyncio.run(_round_with_extra(target, spec, args.seed, metadata, extra))
        if extra is not None:
            rnd, amid = rnd
        rnd.stats_after = wait_idle(handle)
        rounds.append(rnd)
        rss.append(replica_rss(handle))
        print(f"{name} round {index + 1}: {len(rnd.results)} requests in {rnd.wall_s:.1f} s, "
              f"{len(rnd.failures)} unexpected, KV {rnd.stats_after['num_free_kv_blocks']}/"
              f"{rnd.stats_after['num_kv_blocks']} free, RSS MiB "
              f"{ {k: round(v / 2**20) for k, v in rss[-1].items()} }", flush=True)
    orphans = (alive_actors() - actors_deployed, live_placement_groups() - groups_deployed)
    serve.delete(name)
    # Serve stops a deleted replica gracefully first: 33 s on 2 busy cores (two runs, 2026-12-05).
    released = _wait_until(lambda: (alive_actors(), live_placement_groups()) == (actors_before, groups_before), 60)
    totals = [sum(r.values()) for r in rss]
    growth = totals[-1] / totals[-2] - 1 if len(totals) >= 2 else 0.0
    kinds = {k: sum(1 for rnd in rounds for r in rnd.results if r.kind == k) for k in MIX}
    return {"name": name, "model": model, "engine_args": engine_args, "rounds": len(rounds),
            "requests_by_kind": kinds, "unexpected": [asdict(r) for rnd in rounds for r in rnd.failures][:20],
            "num_unexpected": sum(len(rnd.failures) for rnd in rounds),
            "kv_free_after_each_round": [(r.stats_after["num_free_kv_blocks"], r.stats_after["num_kv_blocks"])
                                         for r in rounds],
            "healthy_after_each_round": [r.stats_after["is_healthy"] for r in rounds],
            "orphan_actors": orphans[0], "orphan_placement_groups": orphans[1],
            "released_after_delete": released, "rss_mib": [x / 2**20 for x in totals],
            "rss_mib_by_process": [{k: v / 2**20 for k, v in r.items()} for r in rss], "rss_growth_last_round": growth,
            "deterministic": alone == amid, "latency": latency_row(name, rounds),
            "round_wall_s": [r.wall_s for r in rounds]}


def run_priorities(target: str, model: str, engine_args: dict, args: argparse.Namespace) -> dict:
    """The same round twice on one deployment, every priority equal and then in classes; the report part."""
    from ray import serve

    name = "load-priority"
    handle = deploy(name, model, engine_args, args.stream_interval)
    metadata = [("application", name)]
    spec = LoadSpec(args.clients, args.requests, args.max_new_tokens,
                    json.loads(Path(model, "config.json").read_text())["vocab_size"], args.seed)
    classes = priority_classes(spec, args.seed, [int(p) for p in args.priorities.split(",")])
    rounds = []
    for label, priorities in (("every priority equal", None), ("priorities mixed", classes)):
        rnd = asyncio.run(run_round(target, spec, args.seed, metadata, priorities=priorities))
        rnd.stats_after = wait_idle(handle)
        rounds.append(rnd)
        print(f"{name}, {label}: {len(rnd.results)} requests in {rnd.wall_s:.1f} s, {len(rnd.failures)} unexpected",
              flush=True)
    serve.delete(name)
    return {"name": name, "engine_args": engine_args, "classes": sorted(set(classes)),
            "num_unexpected": sum(len(rnd.failures) for rnd in rounds),
            "unexpected": [asdict(r) for rnd in rounds for r in rnd.failures][:20],
            "kv_free_after_each_round": [(r.stats_after["num_free_kv_blocks"], r.stats_after["num_kv_blocks"])
                                         for r in rounds],
            "rows": priority_rows(rounds[0], rounds[1], classes), "round_wall_s": [r.wall_s for r in rounds]}


async def _round_with_extra(target, spec, seed, metadata, extra):
    if extra is None:
        return await run_round(target, spec, seed, metadata)
    task = asyncio.ensure_future(extra)
    rnd = await run_round(target, spec, seed, metadata)
    return rnd, await task


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def verdict_of_requests(part: dict) -> list[str]:
    """What failed in a part's requests and KV blocks (the priority deployment's whole verdict)."""
    problems = []
    if part["num_unexpected"]:
        problems.append(f"{part['num_unexpected']} requests did not get their tokens or expected status")
    if any(free != total for free, total in part["kv_free_after_each_round"]):
        problems.append(f"KV blocks leaked: {part['kv_free_after_each_round']}")
    return problems


def verdict(part: dict) -> list[str]:
    """What failed in one deployment's part of the report (empty: everything held)."""
    problems = verdict_of_requests(part)
    if part["orphan_actors"] or part["orphan_placement_groups"] or not part["released_after_delete"]:
        problems.append("orphan actors or placement groups")
    if part["rss_growth_last_round"] >= MAX_RSS_GROWTH:
        problems.append(f"RSS grew {100 * part['rss_growth_last_round']:.1f}% in the last round")
    if not part["deterministic"]:
        problems.append("greedy outputs differ alone vs amid the load")
    return problems


def main(argv: list[str] | None = None) -> int:
    from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts

    parser = argparse.ArgumentParser(prog="warpspec bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(BUNDLED_TARGET), help="target checkpoint (default: the bundled one)")
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT), help="EAGLE-3 draft for the speculative deployment")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=500, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds on the plain deployment (RSS: last two)")
    parser.add_argument("--spec-rounds", type=int, default=1, help="rounds on the speculative deployment (0: skip)")
    parser.add_argument("--workers", type=int, default=2, help="ranks per replica (the coordinator holds rank 0)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="per replica (16 tokens each)")
    parser.add_argument("--determinism-tokens", type=int, default=24)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs")
    parser.add_argument("--priorities", default=None,
                        help="comma-separated priority classes, e.g. 0,1,2: add the priority comparison")
    parser.add_argument("--priority-max-num-seqs", type=int, default=8,
                        help="max_num_seqs of the priority deployment (small, so that requests queue)")
    args = parser.parse_args(argv)
    if args.priorities is not None:
        try:
            [int(p) for p in args.priorities.split(",")]
        except ValueError:
            parser.error(f"--priorities must be comma-separated integers, got {args.priorities!r}")

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from warpspec.executor.ray_env import start_local_ray

    start_local_ray(tempfile.mkdtemp(prefix="ws-load-"), num_cpus=8)
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from warpspec.serving.serve_config import GRPC_SERVICER_FUNCTIONS

    port = free_local_port()
    start = time.perf_counter()
    engine_args = {"dtype": "float32", "num_workers": args.workers, "executor": "ray", "max_model_len": 512,
                   "num_kv_blocks": args.num_kv_blocks,
                   "max_waiting_requests": 4096}
    prompts = held_out_prompts()[:6]
    parts, priority_part = [], None
    metrics_port = next(node["MetricsExportPort"] for node in ray.nodes() if node["Alive"])
    sampler = MetricsSampler(f"http://127.0.0.1:{metrics_port}/metrics").start()
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=free_local_port()),
                    grpc_options=gRPCOptions(port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
        target = f"127.0.0.1:{port}"
        sampler.mark("plain")
        parts.append(run_deployment("load-plain", target, args.model, engine_args, args, prompts, args.rounds))
        if args.spec_rounds:
            spec_args = {**engine_args, "draft": args.draft}
            sampler.mark("EAGLE-3")
            parts.append(run_deployment("load-eagle3", target, args.model, spec_args, args, prompts,
                                        args.spec_rounds))
        if args.priorities is not None:
            sampler.mark("priorities")
            priority_part = run_priorities(target, args.model,
                                           {**engine_args, "max_num_seqs": args.priority_max_num_seqs}, args)
    finally:
        sampler.stop()
        serve.shutdown()
        ray.shutdown()
    wall = time.perf_counter() - start

    problems = {p["name"]: verdict(p) for p in parts}
    if priority_part is not None:
        problems[priority_part["name"]] = verdict_of_requests(priority_part)
    report = {"clients": args.clients, "requests_per_round": args.requests, "mix": MIX, "wall_s": wall,
              "parts": parts, "priorities": priority_part, "problems": problems}
    out_dir = Path(args.run_dir, "bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "load.json").write_text(json.dumps(report, indent=2))
    lines = [f"Load over gRPC: {args.clients} streaming clients, {args.requests} requests per round "
             f"({', '.join(f'{100 * v:.0f}% {k}' for k, v in MIX.items())}), {args.workers} workers per replica, "
             f"{wall:.0f} s in all", "", markdown_table([p["latency"] for p in parts]), ""]
    for p in parts:
        lines.append(f"- {p['name']}: {p['rounds']} rounds, {p['num_unexpected']} unexpected outcomes, KV free after "
                     f"each round {p['kv_free_after_each_round']}, orphan actors {p['orphan_actors']}, "
                     f"RSS {', '.join(f'{m:.0f}' for m in p['rss_mib'])} MiB (last round "
                     f"{100 * p['rss_growth_last_round']:+.1f}%), greedy identical alone vs amid load: "
                     f"{p['deterministic']}")
    if priority_part is not None:
        lines += ["", f"Priorities: max_num_seqs {args.priority_max_num_seqs}, the same {args.requests} requests "
                  f"with every priority equal, then in classes {priority_part['classes']} (lower first); completed "
                  "requests only", "", priority_table(priority_part["rows"])]
    try:
        plot(sampler.samples, sampler.marks, f"warpspec bench load: the dashboard's panels ({args.clients} clients)",
             out_dir / "load_dashboard.png")
        lines.append(f"\nThe dashboard's panels over the run ({len(sampler.samples)} reads of Ray's metrics endpoint): "
                     f"{out_dir / 'load_dashboard.png'}")
    except ImportError:  # matplotlib comes with the bench extra
        lines.append("\nmatplotlib is not installed (pip install 'warpspec[bench]'): no plot of the dashboard's panels")
    failed = [f"{name}: {'; '.join(ps)}" for name, ps in problems.items() if ps]
    lines.append("\nall checks passed" if not failed else "\nFAILED: " + " | ".join(failed))
    text = "\n".join(lines) + "\n"
    (out_dir / "load.md").write_text(text)
    print(text)
    return 1 if failed else 0
