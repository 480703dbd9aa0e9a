"""`warpspec bench deterministic`: bf16 greedy output with and without deterministic mode, and what the
mode costs, on the bundled pair.

Two sections, each side by side in one run:
- invariance: per mode, how many of the held-out prompts get other tokens
  - amid a crowd (staggered arrivals through AsyncLLM on a small engine: chunked prefill mixes with
    decodes, and blocks run short enough to preempt) than alone;
  - with the EAGLE-3 draft than without it (all prompts in one batch either way);
  - seeded sampling amid the crowd than alone;
- cost: tokens/s per user at several batch sizes, plain and with EAGLE-3, mode off vs on;
- serve: `warpspec serve` with default settings (bf16) and with --deterministic, 20 greedy
  completions over its OpenAI HTTP API one at a time, then 8 at a time: how many change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks.report import write_report
from warpspec.benchmarks.spec import measure
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams

# Small enough that 16 staggered requests preempt and chunk their prefills.
CROWD_ENGINE = dict(num_kv_blocks=40, max_num_batched_tokens=48)


async def _crowd(engine: AsyncLLM, prompts, params, arrivals) -> list[list[int]]:
    async def one(prompt, p, arrival_s):
        await asyncio.sleep(arrival_s)
        final = None
        async for out in engine.generate(prompt, p):
            final = out
        return final.token_ids

    try:
        return list(await asyncio.gather(*[one(*r) for r in zip(prompts, params, arrivals, strict=True)]))
    finally:
        await engine.shutdown()


def _differ(a: list, b: list) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def measure_invariance(target: str, draft: str, k: int, dtype: str, args) -> list[dict]:
    prompts = held_out_prompts()[: args.num_prompts]
    arrivals = [random.Random(i).uniform(0, args.spread_s) for i in range(len(prompts))]
    greedy = [SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)] * len(prompts)
    seeded = [SamplingParams(max_tokens=args.new_tokens, temperature=0.8, top_p=0.95, seed=100 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    rows = []
    for deterministic in (False, True):
        common = dict(dtype=dtype, deterministic=deterministic)
        with LLM(target, **common) as llm:
            alone = [llm.generate([p], g)[0].token_ids for p, g in
                     tqdm(list(zip(prompts, greedy, strict=True)), desc=f"alone, deterministic={deterministic}")]
            alone_seeded = [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, seeded, strict=True)]
            batch = [o.token_ids for o in llm.generate(prompts, greedy)]
        with LLM(target, draft=draft, num_speculative_tokens=k, compile_draft=False, **common) as llm:
            speculative = [o.token_ids for o in llm.generate(prompts, greedy)]
        crowd = asyncio.run(_crowd(AsyncLLM.from_options(target, **CROWD_ENGINE, **common), prompts, greedy,
                                   arrivals))
        crowd_seeded = asyncio.run(_crowd(AsyncLLM.from_options(target, **CROWD_ENGINE, **common), prompts,
                                          seeded, arrivals))
        rows.append({"deterministic": deterministic, "dtype": dtype, "prompts": len(prompts),
                     "crowd_vs_alone": _differ(crowd, alone), "one_batch_vs_alone": _differ(batch, alone),
                     "eagle3_vs_no_draft": _differ(speculative, batch),
                     "seeded_crowd_vs_alone": _differ(crowd_seeded, alone_seeded)})
    return rows


def measure_cost(target: str, draft: str, k: int, dtype: str, args) -> list[dict]:
    prompts = held_out_prompts()
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        for speculative in (False, True):
            spec_options = dict(draft=draft, num_speculative_tokens=k) if speculative else {}
            rates, tokens = {}, {}
            for deterministic in (False, True):
                with LLM(target, dtype=dtype, deterministic=deterministic, max_num_seqs=max(batch, 1),
                         **spec_options) as llm:
                    rates[deterministic], tokens[deterministic] = measure(llm, batch_prompts, args.new_tokens,
                                                                          args.repeats)
            rows.append({"batch": batch, "eagle3": speculative, "off_tokens_per_s_per_user": rates[False],
                         "on_tokens_per_s_per_user": rates[True], "on_over_off": rates[True] / rates[False],
                         "same_tokens": tokens[True] == tokens[False]})
    return rows


def _complete(port: int, prompt: list[int], new_tokens: int) -> str:
    body = json.dumps({"model": "tiny-maverick", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


def _serve(target: str, deterministic: bool, run_dir: str):
    """`warpspec serve` in a process of its own, returned once it answers on HTTP."""
    from warpspec.serving.serve_cli import free_local_port

    http_port, grpc_port = free_local_port(), free_local_port()
    command = [sys.executable, "-m", "warpspec", "serve", "--model", target, "--http-port", str(http_port),
               "--grpc-port", str(grpc_port), "--arg", f"run_dir={run_dir}"] + \
        (["--deterministic"] if deterministic else [])
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})
    for line in server.stdout:
        if "warpspec: serving" in line:
            return server, http_port
    raise RuntimeError(f"warpspec serve exited with {server.wait()} before serving")


def _stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def measure_serve(target: str, args) -> list[dict]:
    prompts = [held_out_prompts()[i % 16] for i in range(args.serve_requests)]
    rows = []
    for deterministic in (False, True):
        started = time.perf_counter()
        server, port = _serve(target, deterministic, args.run_dir)
        try:
            one_at_a_time = [_complete(port, p, args.new_tokens) for p in tqdm(prompts, desc="serve, one at a time")]
            with ThreadPoolExecutor(args.serve_concurrency) as pool:
                concurrent = list(pool.map(_complete, [port] * len(prompts), prompts,
                                           [args.new_tokens] * len(prompts)))
        finally:
            _stop(server)
        rows.append({"deterministic": deterministic, "requests": len(prompts), "concurrency": args.serve_concurrency,
                     "differ": _differ(concurrent, one_at_a_time), "seconds": time.perf_counter() - started})
    return rows


def tables(results: dict) -> str:
    lines = []
    if "invariance" in results:
        lines += ["| deterministic | dtype | crowd vs alone | one batch vs alone | EAGLE-3 vs no draft "
                  "| seeded, crowd vs alone |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['deterministic']} | {r['dtype']} | {r['crowd_vs_alone']}/{r['prompts']} differ "
                  f"| {r['one_batch_vs_alone']}/{r['prompts']} | {r['eagle3_vs_no_draft']}/{r['prompts']} "
                  f"| {r['seeded_crowd_vs_alone']}/{r['prompts']} |" for r in results["invariance"]]
        lines.append("")
    if "cost" in results:
        lines += ["| batch | EAGLE-3 | off: tok/s/user | on: tok/s/user | on / off | same tokens on and off |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['eagle3']} | {r['off_tokens_per_s_per_user']:.1f} "
                  f"| {r['on_tokens_per_s_per_user']:.1f} | {r['on_over_off']:.2f}x | {r['same_tokens']} |"
                  for r in results["cost"]]
        lines.append("")
    if "serve" in results:
        lines += ["| warpspec serve | greedy completions that change at concurrency 8 vs one at a time |", "|---|---|"]
        lines += [f"| {'--deterministic' if r['deterministic'] else 'defaults (bf16)'} "
                  f"| {r['differ']}/{r['requests']} |" for r in results["serve"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench deterministic", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--sections", default="invariance,cost,serve")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--spread-s", type=float, default=0.5, help="crowd arrivals spread over this many seconds")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-requests", type=int, default=20)
    parser.add_argument("--serve-concurrency", type=int, default=8)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    sections, k = args.sections.split(","), args.num_speculative_tokens
    results: dict[str, list[dict]] = {}
    if "invariance" in sections:
        results["invariance"] = measure_invariance(args.target, args.draft, k, args.dtype, args)
    if "cost" in sections:
        results["cost"] = measure_cost(args.target, args.draft, k, args.dtype, args)
    if "serve" in sections:
        results["serve"] = measure_serve(args.target, args)
    table = tables(results)
    print(f"target {args.target}, draft {args.draft}, k={k}, {args.dtype}, {args.new_tokens} new tokens\n\n{table}")
    write_report(args.run_dir, "deterministic", results, table)
    return 0
