"""`warpspec bench seeds`: seeded sampling with the EAGLE-3 draft, on the bundled pair in float32.

Four measurements, side by side in one run:
- crowd: requests of every kind (greedy, seeded top-p, stop strings, penalties, opted out; every
  kind with and without a long shared opening) arrive staggered through AsyncLLM on a small engine
  (40 KV blocks of 16 tokens, 48 tokens and 12 sequences per step, prefix caching on) and each also
  runs alone; how many differ from alone, per verification mode (deterministic: rejection sampling
  in deterministic mode, against its own runs alone);
- prefix: requests sharing that opening run one after another, prefix caching on vs off: the draft's
  acceptance length and the prompt tokens the cache supplied;
- coupling: rejection sampling vs coupled verification at several temperatures, batch 8: acceptance
  length, tokens/s per user, and whether coupled tokens equal plain decoding's;
- cost: what the promise costs at batch 1, 8 and 32. Under rejection sampling a seeded request drafts
  all it may at every step, whatever the draft-length policy would choose, so that its tokens do not
  depend on the crowd; an unseeded one drafts what the policy chooses. Tokens/s per user of both,
  of coupled verification (seeded, lengths chosen freely) and of plain decoding, in interleaved rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics

from tqdm import tqdm

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks.report import write_report
from warpspec.benchmarks.spec import measure
from warpspec.config.engine import SPECULATIVE_POLICIES
from warpspec.entrypoints.async_llm import AsyncLLM
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams

MODES = ("none", "rejection", "coupled", "deterministic")
CROWD_ENGINE = dict(block_size=16, num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=12)


def _options(mode: str, args: argparse.Namespace, compile_draft: bool = False) -> dict:
    """The engine options of a verification mode: the command line's draft, k and policy. The draft runs
    eagerly unless compile_draft: the crowd and prefix sections start many engines, and their tokens
    are compared, not timed."""
    if mode == "none":
        return {}
    options = dict(draft=args.draft, num_speculative_tokens=args.num_speculative_tokens, compile_draft=compile_draft,
                   speculative_policy=args.speculative_policy)
    extra = {"coupled": {"coupled_verification": True}, "deterministic": {"deterministic": True}}
    return options | extra.get(mode, {})


def shared_opening() -> list[int]:
    """BOS and two held-out prompts: 64 tokens that half the crowd starts with."""
    prompts = held_out_prompts()
    return prompts[0] + prompts[1][1:]


def crowd(num_requests: int, spread_s: float, new_tokens: int, seed: int = 0):
    """(request id, prompt ids, params, arrival in s) of every sampling kind: an odd number of kinds,
    so that each comes with the shared opening and without it."""
    rng, prompts, opening = random.Random(seed), held_out_prompts(), shared_opening()
    kinds = [dict(temperature=0),
             dict(temperature=0.9, top_p=0.9),
             dict(temperature=1.0, top_k=40, stop=["\n\n", ". "]),
             dict(temperature=0.7, repetition_penalty=1.2),
             dict(temperature=0.9, speculation=False)]
    requests = []
    for i in range(num_requests):
        own = prompts[i % len(prompts)]
        prompt = opening + own[1:] if i % 2 == 0 else own
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=1000 + i, **kinds[i % len(kinds)])
        requests.append((f"r{i}", prompt, params, rng.uniform(0, spread_s)))
    return requests


async def _run_crowd(engine: AsyncLLM, requests) -> dict[str, list[int]]:
    async def one(prompt, params, arrival_s):
        await asyncio.sleep(arrival_s)
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        return final.token_ids

    try:
        outs = await asyncio.gather(*[one(prompt, params, arrival) for _, prompt, params, arrival in requests])
    finally:
        await engine.shutdown()
    return {rid: tokens for (rid, *_), tokens in zip(requests, outs, strict=True)}


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first output position where a and b differ (one ending first counts): [5, 6, 7] vs [5, 6] -> 2."""
    return next(i for i, (x, y) in enumerate(zip([*a, None], [*b, None], strict=False)) if x != y)


def measure_crowd(target: str, modes: list[str], args: argparse.Namespace) -> list[dict]:
    requests = crowd(args.crowd_requests, args.spread_s, args.new_tokens)
    alone: dict[str, dict[str, list[int]]] = {}
    rows = []
    for mode in tqdm(modes, desc="crowd"):
        reference = "none" if mode == "coupled" else mode  # coupled promises plain decoding's tokens
        if reference not in alone:
            with LLM(target, dtype="float32", enable_prefix_caching=False, **CROWD_ENGINE,
                     **_options(reference, args)) as llm:
                alone[reference] = {rid: llm.generate([prompt], params)[0].token_ids
                                    for rid, prompt, params, _ in tqdm(requests, desc=f"alone ({reference})")}
        engine = AsyncLLM.from_options(target, dtype="float32", **CROWD_ENGINE, **_options(mode, args))
        got = asyncio.run(_run_crowd(engine, requests))
        differ = [rid for rid, *_ in requests if got[rid] != alone[reference][rid]]
        rows.append({"mode": mode, "compared_with": f"alone, {'no draft' if reference == 'none' else reference}",
                     "first_difference": [_first_difference(got[rid], alone[reference][rid]) for rid in differ],
                     "requests": len(requests), "differ": len(differ), "differing_ids": differ})
    return rows


def measure_prefix(target: str, args: argparse.Namespace) -> list[dict]:
    prompts, opening = held_out_prompts(), shared_opening()
    rows = []
    for temperature in (0.0, 0.7):
        tokens = {}
        for caching in (False, True):
            with LLM(target, dtype="float32", enable_prefix_caching=caching, **_options("rejection", args)) as llm:
                outs = [llm.generate([opening + own[1:]], SamplingParams(max_tokens=args.new_tokens, ignore_eos=True,
                                                                         temperature=temperature, seed=i))[0]
                        for i, own in enumerate(prompts[: args.prefix_requests])]
                acceptance_length = llm.engine.spec_stats.acceptance_length
            tokens[caching] = [o.token_ids for o in outs]
            rows.append({"temperature": temperature, "prefix_caching": caching,
                         "acceptance_length": acceptance_length,
                         "cached_prompt_tokens": sum(o.metrics["cached_prompt_tokens"] for o in outs),
                         "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                         "same_tokens_as_without_caching": tokens[caching] == tokens[False]})
    return rows


def measure_speeds(target: str, sections: list[str], args: argparse.Namespace) -> dict[str, list[dict]]:
    """The coupling and cost sections, on the same three engines: plain, rejection sampling and coupled
    verification (both under --speculative-policy, the draft compiled unless --no-compile-draft)."""
    held_out, results = held_out_prompts(), {}

    def params_for(batch: int, temperature: float, seeded: bool = True) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=args.new_tokens, temperature=temperature, seed=i if seeded else None,
                               ignore_eos=True) for i in range(batch)]

    with LLM(target, dtype="float32") as plain, \
            LLM(target, dtype="float32", **_options("rejection", args, args.compile_draft)) as rejection, \
            LLM(target, dtype="float32", **_options("coupled", args, args.compile_draft)) as coupled:
        if "coupling" in sections:
            prompts, rows = held_out[: args.batch], []
            for temperature in [float(t) for t in args.temperatures.split(",")]:
                params = params_for(len(prompts), temperature)
                plain_rate, plain_tokens = measure(plain, prompts, args.new_tokens, args.repeats, params)
                rejection_rate, _ = measure(rejection, prompts, args.new_tokens, args.repeats, params)
                coupled_rate, coupled_tokens = measure(coupled, prompts, args.new_tokens, args.repeats, params)
                rows.append({"temperature": temperature, "batch": len(prompts),
                             "plain_tokens_per_s_per_user": plain_rate,
                             "rejection_tokens_per_s_per_user": rejection_rate,
                             "rejection_acceptance_length": rejection.engine.spec_stats.acceptance_length,
                             "coupled_tokens_per_s_per_user": coupled_rate,
                             "coupled_acceptance_length": coupled.engine.spec_stats.acceptance_length,
                             "coupled_same_tokens_as_plain": coupled_tokens == plain_tokens})
            results["coupling"] = rows
        if "cost" in sections:
            rows, temperature = [], args.cost_temperature
            configs = {"plain": (plain, True), "unseeded": (rejection, False), "seeded": (rejection, True),
                       "coupled": (coupled, True)}
            for batch in tqdm([int(b) for b in args.cost_batch_sizes.split(",")], desc="cost"):
                prompts = [held_out[i % len(held_out)] for i in range(batch)]
                rates = {name: [] for name in configs}
                acceptance = {name: [] for name in configs}
                for _ in range(args.repeats):  # interleaved rounds: a drifting host moves every config alike
                    for name, (llm, seeded) in configs.items():
                        rate, _ = measure(llm, prompts, args.new_tokens, 1, params_for(batch, temperature, seeded))
                        rates[name].append(rate)
                        acceptance[name].append(llm.engine.spec_stats.acceptance_length)
                row = {"batch": batch, "temperature": temperature}
                for name in configs:
                    row[f"{name}_tokens_per_s_per_user"] = statistics.median(rates[name])
                    row[f"{name}_tokens_per_s_per_user_runs"] = rates[name]
                    row[f"{name}_acceptance_length"] = statistics.mean(acceptance[name])
                row["seeded_vs_unseeded"] = row["seeded_tokens_per_s_per_user"] / row["unseeded_tokens_per_s_per_user"]
                row["seeded_vs_unseeded_runs"] = [seeded_rate / unseeded_rate for seeded_rate, unseeded_rate
                                                  in zip(rates["seeded"], rates["unseeded"], strict=True)]
                rows.append(row)
            results["cost"] = rows
    return results


def tables(results: dict) -> str:
    lines = []
    if "crowd" in results:
        lines += ["| verification | compared with | requests whose tokens differ (id@first differing token) |",
                  "|---|---|---|"]
        for r in results["crowd"]:
            counts = [f"{r['differ']}/{r['requests']}"]
            counts += [f"{rid}@{i}" for rid, i in zip(r["differing_ids"], r["first_difference"], strict=True)]
            lines.append(f"| {r['mode']} | {r['compared_with']} | {' '.join(counts)} |")
        lines.append("")
    if "prefix" in results:
        lines += ["| temperature | prefix caching | prompt tokens from the cache | acceptance length | same tokens |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['temperature']} | {'on' if r['prefix_caching'] else 'off'} | {r['cached_prompt_tokens']}/"
                  f"{r['prompt_tokens']} | {r['acceptance_length']:.3f} | {r['same_tokens_as_without_caching']} |"
                  for r in results["prefix"]]
        lines.append("")
    if "coupling" in results:
        lines += ["| temperature | batch | plain tok/s/user | rejection: acceptance, tok/s/user "
                  "| coupled: acceptance, tok/s/user | coupled tokens = plain tokens |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['temperature']} | {r['batch']} | {r['plain_tokens_per_s_per_user']:.1f} "
                  f"| {r['rejection_acceptance_length']:.2f}, {r['rejection_tokens_per_s_per_user']:.1f} "
                  f"| {r['coupled_acceptance_length']:.2f}, {r['coupled_tokens_per_s_per_user']:.1f} "
                  f"| {r['coupled_same_tokens_as_plain']} |" for r in results["coupling"]]
        lines.append("")
    if "cost" in results:
        lines += ["| batch | temperature | plain tok/s/user | unseeded: acceptance, tok/s/user "
                  "| seeded: acceptance, tok/s/user | seeded / unseeded (rounds) "
                  "| coupled (seeded): acceptance, tok/s/user |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['temperature']} | {r['plain_tokens_per_s_per_user']:.1f} "
                  f"| {r['unseeded_acceptance_length']:.2f}, {r['unseeded_tokens_per_s_per_user']:.1f} "
                  f"| {r['seeded_acceptance_length']:.2f}, {r['seeded_tokens_per_s_per_user']:.1f} "
                  f"| {r['seeded_vs_unseeded']:.2f}x ({min(r['seeded_vs_unseeded_runs']):.2f}-"
                  f"{max(r['seeded_vs_unseeded_runs']):.2f}) "
                  f"| {r['coupled_acceptance_length']:.2f}, {r['coupled_tokens_per_s_per_user']:.1f} |"
                  for r in results["cost"]]
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench seeds", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--speculative-policy", choices=SPECULATIVE_POLICIES, default="adaptive",
                        help="how each step's number of drafts is chosen (the engine's option; fixed: k every step, "
                             "and no step timing at start-up)")
    parser.add_argument("--sections", default="crowd,prefix,coupling,cost")
    parser.add_argument("--compile-draft", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the draft of the timed sections (coupling, cost), as an engine does by default")
    parser.add_argument("--modes", default=",".join(MODES), help="verification modes of the crowd section")
    parser.add_argument("--crowd-requests", type=int, default=40)
    parser.add_argument("--spread-s", type=float, default=3.0, help="arrivals spread over this many seconds")
    parser.add_argument("--prefix-requests", type=int, default=8)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cost-batch-sizes", default="1,8,32")
    parser.add_argument("--cost-temperature", type=float, default=0.8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    sections, k = args.sections.split(","), args.num_speculative_tokens
    results: dict[str, list[dict]] = {}
    if "crowd" in sections:
        results["crowd"] = measure_crowd(args.target, args.modes.split(","), args)
    if "prefix" in sections:
        results["prefix"] = measure_prefix(args.target, args)
    if "coupling" in sections or "cost" in sections:
        results |= measure_speeds(args.target, sections, args)
    table = tables(results)
    timed_draft = "compiled" if args.compile_draft else "eager"
    print(f"target {args.target}, draft {args.draft}, k={k} ({args.speculative_policy}), float32, "
          f"{args.new_tokens} new tokens, median of {args.repeats}; draft {timed_draft} where timed\n\n{table}")
    write_report(args.run_dir, "seeds", results, table)
    return 0
