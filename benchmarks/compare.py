"""`warpspec bench compare`: the headline comparison on the bundled model pair, in one run, same
prompts (held-out documentation excerpts) and output lengths: transformers `generate` greedy,
transformers assisted generation by prompt lookup (k=3), warpspec without speculation, with EAGLE-3
and with its own prompt lookup drafts (speculative_method="ngram", k=3), on 1 and 2 workers, at batch
1 and 8, and with --vllm, vLLM's CPU build plain and with the same draft (benchmarks/vllm_peer.py).
Where warpspec compiles its steps (one rank on a CPU) it also runs with enforce_eager, side by side.
Batch 1 runs each of the first --batch1-prompts held-out prompts alone and reports the median over
them (acceptance varies by prompt); a larger batch runs the first prompts together. Tokens/s per
user, ratios to transformers' greedy, and the draft's share of step time; Markdown, JSON and a PNG
bar chart under runs/bench/. Every configuration runs greedy, so all of them must emit the same
tokens (checked, and reported). The header says how OpenMP threads wait (OMP_WAIT_POLICY,
GOMP_SPINCOUNT) and how many torch uses: on a CPU each changes every figure.

Another pair: --target, --draft and --prompts (equal-length token ids in the held-out prompts' JSON
format); any engine option of `warpspec serve` (--block-size, --max-num-seqs, ...) applies to every
warpspec engine, except those the comparison sets per system (OWN_OPTIONS).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, PROMPTS
from warpspec.benchmarks.vllm_peer import VLLMPeer, check_python
from warpspec.config.engine import SPECULATIVE_POLICIES
from warpspec.config.options import add_engine_flags, engine_options_from_flags
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.workers.models.registry import load_model_config

HF_GREEDY = "transformers greedy"
HF_LOOKUP = "transformers prompt lookup (k=3)"
VLLM, VLLM_EAGLE3 = "vLLM", "vLLM + EAGLE-3 (k=3)"
LOOKUP = "warpspec + prompt lookup (k=3)"  # speculative_method="ngram", transformers' prompt lookup's peer
EAGER = " eager"  # "warpspec eager": enforce_eager=True
# Engine options the comparison sets itself, per system: the rest are flags, the same for every engine.
OWN_OPTIONS = ("dtype", "enforce_eager", "run_dir", "num_workers", "executor", "comm_backend",
               "enable_prefix_caching", "draft", "speculative_method", "num_speculative_tokens", "speculative_policy")


def read_prompts(path: str, vocab_size: int) -> list[list[int]]:
    """The prompts of a file in the held-out prompts' format ({"prompt_token_ids": [[...], ...]}), checked:
    transformers runs a batch unpadded, so every prompt has the same length."""
    try:
        prompts = json.loads(Path(path).read_text())["prompt_token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"--prompts: {path} is no JSON object with a prompt_token_ids list "
                         f"({type(error).__name__}: {error})") from None
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise SystemExit(f"--prompts: prompt_token_ids in {path} must be a non-empty list of non-empty lists "
                         "of token ids")
    if len({len(p) for p in prompts}) > 1:
        raise SystemExit(f"--prompts: every prompt must have the same length (transformers runs a batch unpadded), "
                         f"got lengths {sorted({len(p) for p in prompts})}")
    outside = next(((i, t) for i, p in enumerate(prompts) for t in p if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise SystemExit(f"--prompts: prompt {outside[0]} holds token id {outside[1]}, outside the target's "
                         f"vocabulary (vocab_size {vocab_size})")
    return prompts


def warpspec_runner(llm: LLM, new_tokens: int) -> Callable[[list[list[int]]], list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return lambda prompts: [o.token_ids for o in llm.generate(prompts, params)]


def transformers_runner(model, new_tokens: int, prompt_lookup: bool) -> Callable[[list[list[int]]], list[list[int]]]:
    def run(prompts: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(prompts)  # equal lengths: no padding
        extra = {"prompt_lookup_num_tokens": 3} if prompt_lookup else {}
        with torch.no_grad():
            # eos is unset on the model (main), so every run produces exactly new_tokens.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                 pad_token_id=0, **extra)
        return out[:, ids.shape[1] :].tolist()

    return run


def timed(run: Callable, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """The wall time of run(prompts), or the time a peer process measured for it (its own generate)."""
    start = time.perf_counter()
    tokens = run(prompts)
    return getattr(tokens, "wall_s", time.perf_counter() - start), tokens


def thread_choices(systems: list[dict]) -> dict[str, dict[str, int]]:
    """The thread count each in-process compiled graph runs with, per system (workers/compile/cpu_threads.py),
    keyed "(query length, one sequence)"; the draft's graphs are marked "draft"."""
    chosen = {}
    for s in systems:
        engine = s["llm"].engine if "llm" in s else None
        runner = getattr(getattr(engine, "executor", None), "runner", None)
        graphs = getattr(getattr(runner, "graph_runner", None), "thread_counts", {})
        drafts = getattr(getattr(getattr(engine, "proposer", None), "graphs", None), "thread_counts", {})
        counts = {str(g): n for g, n in graphs.items()} | {f"draft {g}": n for g, n in drafts.items()}
        if counts:
            chosen[f"{s['system']} ({s['workers']})"] = counts
    return chosen


def format_table(rows: list[dict], batches: list[int]) -> str:
    head = "| system | workers | " + " | ".join(f"batch {b}: tok/s per user | vs transformers" for b in batches)
    lines = [head + " | acceptance length (batch 1) | draft share of step time (batch 1) | same tokens as "
             "transformers |", "|---|---|" + "---|---|" * len(batches) + "---|---|---|"]
    for r in rows:
        cells = []
        for b in batches:
            rate = r["tokens_per_s_per_user"].get(str(b))
            ratio = r["ratio_to_transformers"].get(str(b))
            cells.append("n/a | n/a" if rate is None else f"{rate:.1f} | {ratio:.2f}x")
        accept = r.get("acceptance_length", {}).get("1")
        share = r.get("draft_share", {}).get("1")
        lines.append(f"| {r['system']} | {r['workers'] or '-'} | " + " | ".join(cells)
                     + f" | {'-' if accept is None else f'{accept:.2f}'} | {'-' if share is None else f'{share:.0%}'}"
                     f" | {r['same_tokens']} |")
    return "\n".join(lines)


def eagle3_system(policy: str, policies: list[str]) -> str:
    """The EAGLE-3 engine's name in the table; the policy is named when several run."""
    return "warpspec + EAGLE-3 (k=3)" if policies == ["fixed"] else f"warpspec + EAGLE-3 ({policy})"


def policy_table(rows: list[dict], batches: list[int]) -> str:
    """With both draft length policies: per worker layout and batch, adaptive against the better of
    plain decoding and fixed k=3 (issue 40's goal: >= 0.97x everywhere). Empty otherwise."""
    def rate(system: str, workers, batch: int) -> float | None:
        return next((r["tokens_per_s_per_user"].get(str(batch)) for r in rows
                     if r["system"] == system and r["workers"] == workers), None)

    lines = []
    for workers in dict.fromkeys(r["workers"] for r in rows if r["system"].endswith("(adaptive)")):
        plain_name = next(r["system"] for r in rows if r["workers"] == workers and r["system"].startswith("warpspec")
                          and "+" not in r["system"])
        eager = plain_name.removeprefix("warpspec")
        cells = []
        for b in batches:
            plain, fixed = rate(plain_name, workers, b), rate(f"warpspec{eager} + EAGLE-3 (fixed)", workers, b)
            adaptive = rate(f"warpspec{eager} + EAGLE-3 (adaptive)", workers, b)
            cells.append("n/a" if None in (plain, fixed, adaptive) else f"{adaptive / max(plain, fixed):.2f}x "
                         f"({'plain' if plain >= fixed else 'fixed'} {max(plain, fixed):.0f})")
        lines.append(f"| {workers} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = "| workers | " + " | ".join(f"batch {b}: adaptive vs the better" for b in batches) + " |"
    return "\n\n" + "\n".join([head, "|---|" + "---|" * len(batches), *lines])


def peer_table(rows: list[dict], batches: list[int]) -> str:
    """With --vllm: each warpspec engine of one rank against vLLM's, plain against plain and EAGLE-3
    against EAGLE-3 (issue 40's goal: >= 1.0x at every batch size). Empty otherwise."""
    peers = {r["system"]: r for r in rows if r["system"] in (VLLM, VLLM_EAGLE3)}
    if not peers:
        return ""
    lines = ["| warpspec engine | " + " | ".join(f"batch {b}: vs vLLM" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for r in rows:
        if not r["system"].startswith("warpspec") or r["workers"] not in ("1", "ray1"):
            continue
        if LOOKUP in r["system"]:
            continue  # vLLM's CPU build is run without its n-gram drafts
        peer = peers.get(VLLM_EAGLE3 if "EAGLE" in r["system"] else VLLM)
        cells = []
        for b in batches:
            mine, theirs = r["tokens_per_s_per_user"].get(str(b)), peer and peer["tokens_per_s_per_user"].get(str(b))
            cells.append("n/a" if not (mine and theirs) else f"{mine / theirs:.2f}x")
        lines.append(f"| {r['system']} ({r['workers']}) | " + " | ".join(cells) + " |")
    return "\n\n" + "\n".join(lines)


def plot(rows: list[dict], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        label = r["system"] + (f", workers {r['workers']}" if r["workers"] else "")
        values = [r["tokens_per_s_per_user"].get(str(b)) or 0 for b in batches]
        ax.bar([x + i * width for x in range(len(batches))], values, width, label=label)
    ax.set_xticks([x + width * (len(rows) - 1) / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("output tokens / s per user")
    ax.set_title("Bundled tiny-maverick pair, greedy, same prompts (CPU)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def worker_layout(spec: str) -> tuple[str, int, str, str]:
    """--workers entry -> (spec, num_workers, executor, comm_backend): "1" in this process, "ray1" one
    worker through Ray (the coordinator's engine core), "2" two, "2:gloo" two meeting over gloo."""
    count, _, comm_backend = spec.partition(":")
    executor = "ray" if count.startswith("ray") else "auto"
    return spec, int(count.removeprefix("ray")), executor, comm_backend or "auto"


def step_modes(num_workers: int, eager_only: bool = False, compiled_only: bool = False) -> list[tuple[str, bool]]:
    """(name suffix, enforce_eager): one rank on a CPU compiles its steps by default, and its eager run
    goes beside it unless compiled_only; eager_only (--enforce-eager) runs every engine eager and
    compiles nothing."""
    if eager_only:
        return [(EAGER, True)]
    return [("", False), (EAGER, True)] if num_workers == 1 and not compiled_only else [("", False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench compare", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--workers", default="1,ray1,2",
                        help="warpspec worker counts: 1 in this process, rayN N workers through Ray, N > 1 likewise; "
                             "a suffix names the ranks' collectives, as 2:gloo (else comm_backend auto)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per configuration (median kept)")
    parser.add_argument("--prompts", default=str(PROMPTS),
                        help="equal-length token-id prompts, a JSON file as the bundled held-out prompts "
                             '({"prompt_token_ids": [[...], ...]}); default: those')
    parser.add_argument("--batch1-prompts", type=int, default=4,
                        help="batch 1: run each of this many prompts alone, report the median")
    parser.add_argument("--dtype", default="float32", help="both engines compute in this dtype")
    parser.add_argument("--run-dir", default="runs")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="every warpspec engine eager: no start-up compile (minutes cold), eager speed only")
    parser.add_argument("--compiled-only", action="store_true",
                        help="no eager run beside one rank's compiled engines (the draft length sweep)")
    parser.add_argument("--vllm", metavar="PYTHON",
                        help="also run vLLM's CPU build, plain and with the draft: the Python of a venv that has it "
                             "(make vllm-peer: runs/vllm-venv/bin/python)")
    parser.add_argument("--methods", default="eagle3,ngram",
                        help="the drafters warpspec runs with besides plain decoding: eagle3 (the draft, one engine "
                             "per draft length policy), ngram (prompt lookup, k=3, fixed), or one of them")
    parser.add_argument("--speculative-policies", default="fixed",
                        help="one EAGLE-3 engine per draft length policy: fixed (k=3 at every step), adaptive "
                             "(each step's length from measured costs), or both: fixed,adaptive")
    add_engine_flags(parser, skip=OWN_OPTIONS)
    args = parser.parse_args(argv)
    try:
        engine_options = engine_options_from_flags(args, skip=OWN_OPTIONS)
    except ValueError as error:  # names the option and what it must be
        raise SystemExit(str(error)) from None
    try:
        from transformers import Llama4ForCausalLM
    except ImportError:
        raise SystemExit("the comparison runs transformers beside warpspec: pip install 'warpspec[test]'") from None
    batches = [int(b) for b in args.batch_sizes.split(",")]
    policies = args.speculative_policies.split(",")
    if not policies or any(p not in SPECULATIVE_POLICIES for p in policies):
        raise SystemExit(f"--speculative-policies: a list of {', '.join(SPECULATIVE_POLICIES)}, got "
                         f"{args.speculative_policies!r}")
    methods = args.methods.split(",")
    if not methods or any(m not in ("eagle3", "ngram") for m in methods):
        raise SystemExit(f"--methods: a list of eagle3, ngram, got {args.methods!r}")
    if args.vllm:
        check_python(args.vllm)
    prompts = read_prompts(args.prompts, load_model_config(args.target).vocab_size)
    if not 1 <= args.batch1_prompts <= len(prompts):
        raise SystemExit(f"--batch1-prompts: between 1 and {len(prompts)} (the prompts in {args.prompts})")

    reference = Llama4ForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    reference.generation_config.eos_token_id = None
    systems: list[dict] = [{"system": HF_GREEDY, "workers": 0, "run": transformers_runner(reference, args.new_tokens,
                                                                                          False)},
                           {"system": HF_LOOKUP, "workers": 0, "batches": [1],  # transformers: batch 1 only
                            "run": transformers_runner(reference, args.new_tokens, True)}]
    layouts = [worker_layout(spec) for spec in args.workers.split(",")]
    # Every engine through Ray holds a CPU per worker, all of them at once (plain and EAGLE-3, compiled
    # and eager): a local cluster must offer that many, oversubscribing a small machine.
    ray_cpus = sum(2 * len(step_modes(n, args.enforce_eager, args.compiled_only)) * n
                   for _, n, executor, _ in layouts if executor == "ray" or n > 1)
    if ray_cpus:
        from warpspec.executor.ray_env import connect_ray

        connect_ray(args.run_dir, num_cpus=ray_cpus)
    # (name, drafter options, draft length policy) of each warpspec engine on every worker layout.
    speculating = [(eagle3_system(policy, policies), {"draft": args.draft}, policy)
                   for policy in policies if "eagle3" in methods]
    speculating += [(LOOKUP, {"speculative_method": "ngram"}, "fixed")] if "ngram" in methods else []
    engines = [(layout, mode, system) for layout in layouts for mode, system in itertools.product(
        step_modes(layout[1], args.enforce_eager, args.compiled_only), (("warpspec", {}, "fixed"), *speculating))]
    with contextlib.ExitStack() as stack:
        if args.vllm:
            print("starting vLLM's two engines (plain, EAGLE-3) in their own process: minutes, they compile")
            peer = VLLMPeer(args.vllm, Path(args.target), Path(args.draft), args.dtype,
                            Path(args.run_dir, "bench", "vllm"))
            stack.callback(peer.close)
            print(f"vLLM {peer.version} started: " + ", ".join(f"{k} {v:.0f} s" for k, v in peer.start_s.items()))
            systems += [{"system": VLLM, "workers": 0, "run": peer.runner("plain", args.new_tokens)},
                        {"system": VLLM_EAGLE3, "workers": 0, "peer": peer,
                         "run": peer.runner("eagle3", args.new_tokens)}]
        # Each engine compiles its steps as it starts (cached under --run-dir): minutes, cold.
        for (workers, num_workers, executor, comm_backend), (mode, enforce_eager), (name, drafter, policy) in tqdm(
                engines, desc="start engines", unit="engine"):
            llm = stack.enter_context(LLM(args.target, dtype=args.dtype, num_workers=num_workers, **drafter,
                                          executor=executor, comm_backend=comm_backend,
                                          enable_prefix_caching=False, speculative_policy=policy,
                                          enforce_eager=enforce_eager, run_dir=args.run_dir, **engine_options))
            systems.append({"system": name.replace("warpspec", "warpspec" + mode), "workers": workers,
                            "llm": llm, "run": warpspec_runner(llm, args.new_tokens)})
        for s in systems:  # warm up (and compile the drafts) outside the measurement
            s["run"](prompts[:1])
        results = {s["system"] + str(s["workers"]): {} for s in systems}
        num_runs = sum((args.batch1_prompts if batch == 1 else 1) * args.repeats
                       * sum(batch in s.get("batches", batches) for s in systems) for batch in batches)
        progress = tqdm(total=num_runs, desc="timed generations", unit="run")
        for batch in batches:
            # Batch 1: each prompt alone, median over them; a larger batch: the first prompts at once, the
            # held-out prompts repeated past their number (no prefix caching: each is computed anew).
            prompt_sets = ([[p] for p in prompts[: args.batch1_prompts]] if batch == 1
                           else [[prompts[i % len(prompts)] for i in range(batch)]])
            rates: dict[str, list[float]] = {key: [] for key in results}
            tokens: dict[str, list[list[int]]] = {key: [] for key in results}
            spec_before = {key: copy.deepcopy(s["llm"].engine.spec_stats) if "llm" in s
                           else s["peer"].request(cmd="spec_counts") for s in systems if "llm" in s or "peer" in s
                           for key in [s["system"] + str(s["workers"])]}
            for batch_prompts in prompt_sets:
                # Interleave the systems and repeat: this machine's speed drifts over a minute.
                walls: dict[str, list[float]] = {key: [] for key in results}
                for _ in range(args.repeats):
                    for s in systems:
                        if batch not in s.get("batches", batches):
                            continue
                        key = s["system"] + str(s["workers"])
                        wall, out = timed(s["run"], batch_prompts)
                        progress.update()
                        walls[key].append(wall)
                        if len(walls[key]) == 1:
                            tokens[key] += out
                for key, values in walls.items():
                    if values:
                        rates[key].append(args.new_tokens / statistics.median(values))
            for s in systems:
                key = s["system"] + str(s["workers"])
                if not rates[key]:
                    continue
                spec = s["llm"].engine.spec_stats.since(spec_before[key]) if "llm" in s else None
                acceptance = spec.acceptance_length if spec else None
                if "peer" in s:  # vLLM's own counters
                    acceptance = s["peer"].acceptance_length(spec_before[key], s["peer"].request(cmd="spec_counts"))
                results[key][batch] = {"tokens": tokens[key], "tokens_per_s_per_user": statistics.median(rates[key]),
                                       "per_prompt": rates[key], "acceptance_length": acceptance,
                                       "draft_share": spec.draft_share if spec else None}
        progress.close()
        threads = thread_choices(systems)  # while the engines are up
    rows = []
    for s in systems:
        measured = results[s["system"] + str(s["workers"])]
        greedy = results[HF_GREEDY + "0"]
        rows.append({
            "system": s["system"], "workers": s["workers"],
            "tokens_per_s_per_user": {str(b): m["tokens_per_s_per_user"] for b, m in measured.items()},
            "ratio_to_transformers": {str(b): m["tokens_per_s_per_user"] / greedy[b]["tokens_per_s_per_user"]
                                      for b, m in measured.items()},
            "acceptance_length": {str(b): m["acceptance_length"] for b, m in measured.items()
                                  if m["acceptance_length"]},
            "draft_share": {str(b): m["draft_share"] for b, m in measured.items() if m["draft_share"]},
            "per_prompt_batch1": measured.get(1, {}).get("per_prompt"),
            "same_tokens": all(m["tokens"] == greedy[b]["tokens"] for b, m in measured.items()),
        })
    table = format_table(rows, batches) + policy_table(rows, batches) + peer_table(rows, batches)
    print(f"target {args.target}, draft {args.draft}, {args.dtype}, {len(prompts[0])}-token prompts from "
          f"{args.prompts}, {args.new_tokens} new tokens, greedy, median of {args.repeats} interleaved runs; batch 1: "
          f"median over {args.batch1_prompts} prompts run alone; engine options {engine_options or 'the defaults'}")
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: spinning)')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')}, torch threads "
          f"{torch.get_num_threads()}; compiled graphs' thread counts: {threads}\n")
    print(table)
    out = Path(args.run_dir, "bench")
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "compare.md").write_text(table + "\n")
    plot(rows, batches, out / "compare.png")
    print(f"\nwrote {out / 'compare.json'}, compare.md, compare.png")
    return 0
