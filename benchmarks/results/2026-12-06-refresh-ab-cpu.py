"""Plain, fixed k = 3, adaptive as it was and adaptive with stale figures refreshed, side by side in one
process on this CPU: the script behind 2026-12-06-refresh-ab-cpu.md, kept as it ran. Bundled pair,
greedy, compiled steps, no prefix caching; the four engines interleaved, REPEATS runs each per batch.
"adaptive before" runs the same code with the refresh off (REFRESH_STEPS past any run) and the cost
model's step count frozen (every observation then weighs ALPHA, as before). Environment: BATCHES,
NEW, REPEATS, DTYPE; writes refresh_ab.json under runs/."""
import json
import os
import statistics
import time
from pathlib import Path

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode import draft_length

batches = [int(b) for b in os.environ.get("BATCHES", "32,64").split(",")]
new = int(os.environ.get("NEW", "128"))
repeats = int(os.environ.get("REPEATS", "7"))
dtype = os.environ.get("DTYPE", "float32")
prompts = held_out_prompts()
params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
common = dict(dtype=dtype, enable_prefix_caching=False, max_num_seqs=64, enforce_eager=False, run_dir="runs")
draft = {"draft": str(BUNDLED_DRAFT)}
configs = {"plain": {}, "fixed": {**draft, "speculative_policy": "fixed"},
           "adaptive before": {**draft, "speculative_policy": "adaptive"},
           "adaptive": {**draft, "speculative_policy": "adaptive"}}
REFRESH = draft_length.REFRESH_STEPS
engines = {}
for name, extra in configs.items():
    engines[name] = LLM(str(BUNDLED_TARGET), **common, **extra)
    engines[name].generate(prompts[:2], params)
    print(name, "started", flush=True)
engines["adaptive before"].engine.step_costs.advance = lambda: None
results = {}
for b in batches:
    ps = [prompts[i % len(prompts)] for i in range(b)]
    seconds, tokens = {n: [] for n in engines}, {}
    chosen_before = {n: dict(llm.engine.draft_lengths.num_chosen) for n, llm in engines.items()
                     if n.startswith("adaptive")}
    refreshes_before = engines["adaptive"].engine.draft_lengths.num_refreshes
    for _ in range(repeats):
        for name, llm in engines.items():
            draft_length.REFRESH_STEPS = 10**9 if name == "adaptive before" else REFRESH
            start = time.perf_counter()
            outs = llm.generate(ps, params)
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = [o.token_ids for o in outs]
    per_user = {n: new / statistics.median(v) for n, v in seconds.items()}
    better = max(per_user["plain"], per_user["fixed"])
    results[b] = {
        "tokens_per_s_per_user": per_user, "run_s_spread": {n: [min(v), max(v)] for n, v in seconds.items()},
        "vs_better": {n: per_user[n] / better for n in ("adaptive before", "adaptive")},
        "same_tokens": all(tokens[n] == tokens["plain"] for n in tokens),
        "chosen": {n: {k: v - chosen_before[n].get(k, 0) for k, v in llm.engine.draft_lengths.num_chosen.items()}
                   for n, llm in engines.items() if n.startswith("adaptive")},
        "refreshes": engines["adaptive"].engine.draft_lengths.num_refreshes - refreshes_before}
    print(b, {n: round(v, 1) for n, v in per_user.items()},
          {n: round(v, 3) for n, v in results[b]["vs_better"].items()}, results[b]["chosen"],
          "refreshes", results[b]["refreshes"], "same tokens", results[b]["same_tokens"], flush=True)
report = {"dtype": dtype, "new_tokens": new, "repeats": repeats, "results": results,
          "step_costs": {n: engines[n].engine.stats().step_costs for n in ("adaptive before", "adaptive")}}
Path("runs").mkdir(exist_ok=True)
Path("runs/refresh_ab.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
for llm in engines.values():
    llm.shutdown()
