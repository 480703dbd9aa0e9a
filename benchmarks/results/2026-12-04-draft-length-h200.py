"""Plain, fixed k=3 and adaptive draft length side by side on one device, bundled pair, greedy: the
script behind 2026-12-04-draft-length-h200.md, kept as it ran (next time: warpspec bench compare).
Environment: BATCHES, NEW, DTYPE; writes draft_length_gpu.json under $OUT."""
import json
import os
import statistics
import time
from pathlib import Path

import torch

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams

out = Path(os.environ.get("OUT", "runs/gpu/out"))
out.mkdir(parents=True, exist_ok=True)
batches = [int(b) for b in os.environ.get("BATCHES", "1,2,4,8,16,32,64").split(",")]
new = int(os.environ.get("NEW", "128"))
dtype = os.environ.get("DTYPE", "bfloat16")
prompts = held_out_prompts()
params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
common = dict(dtype=dtype, enable_prefix_caching=False, max_num_seqs=64,
              cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64))
engines, startup = {}, {}
for name, extra in (("plain", {}), ("fixed", {"draft": str(BUNDLED_DRAFT), "speculative_policy": "fixed"}),
                    ("adaptive", {"draft": str(BUNDLED_DRAFT), "speculative_policy": "adaptive"})):
    start = time.perf_counter()
    engines[name] = LLM(str(BUNDLED_TARGET), **common, **extra)
    startup[name] = time.perf_counter() - start
    engines[name].generate(prompts[:2], params)
    print(name, "started in", round(startup[name], 1), "s on", engines[name].engine.config.device, flush=True)
results = {}
for b in batches:
    ps = [prompts[i % len(prompts)] for i in range(b)]
    rates, tokens = {n: [] for n in engines}, {}
    for _ in range(3):
        for name, llm in engines.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(ps, params)
            rates[name].append(b * new / (time.perf_counter() - t))
            tokens[name] = [o.token_ids for o in outs]
    med = {n: statistics.median(v) for n, v in rates.items()}
    results[b] = {"total_tokens_per_s": med, "spread": {n: [min(v), max(v)] for n, v in rates.items()},
                  "fixed_vs_plain": med["fixed"] / med["plain"],
                  "adaptive_vs_better": med["adaptive"] / max(med["plain"], med["fixed"]),
                  "same_tokens_fixed_adaptive": tokens["fixed"] == tokens["adaptive"],
                  "same_tokens_plain_fixed": tokens["plain"] == tokens["fixed"]}
    print(b, {n: round(v) for n, v in med.items()}, round(results[b]["fixed_vs_plain"], 2),
          round(results[b]["adaptive_vs_better"], 2), flush=True)
stats = engines["adaptive"].engine.stats()
report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "dtype": dtype,
          "new_tokens": new, "startup_s": startup, "results": results, "step_costs": stats.step_costs,
          "acceptance_rates": stats.acceptance_rates,
          "chosen": engines["adaptive"].engine.draft_lengths.num_chosen}
(out / "draft_length_gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
print(json.dumps({"step_costs": stats.step_costs, "chosen": report["chosen"]}, default=str))
