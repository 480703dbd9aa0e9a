"""Adaptive against fixed k = 3 at one batch size, more runs than a compare sitting gives it: the bundled
pair, 128 new tokens, greedy, the held-out prompts repeated to the batch (as `warpspec bench compare`
does), the two engines interleaved. Prints each engine's tokens/s per user (median and every run), the
draft lengths the adaptive engine chose after its warm-up generation, and its cost table's rows for
batches 1, 2 and 4.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 python benchmarks/results/2026-12-06-adaptive-reruns-cpu.py 2 float32 7
"""

import json
import statistics
import sys
import time
from pathlib import Path

from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 2
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 7
held_out = json.loads(Path("assets/held_out_prompts.json").read_text())["prompt_token_ids"]
prompts = [held_out[i % len(held_out)] for i in range(batch)]
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llms = {policy: LLM("assets/tiny-maverick", dtype=dtype, draft="assets/tiny-maverick-eagle3",
                    enable_prefix_caching=False, speculative_policy=policy, run_dir="runs")
        for policy in ("fixed", "adaptive")}
for llm in llms.values():
    llm.generate(prompts[:1], params)
policy = llms["adaptive"].engine.draft_lengths
before = dict(policy.num_chosen)
seconds: dict[str, list[float]] = {name: [] for name in llms}
for _ in range(repeats):
    for name, llm in llms.items():
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds[name].append(time.perf_counter() - start)
for name, runs in seconds.items():
    print(name, f"{128 / statistics.median(runs):.1f} tok/s per user", [round(128 / s) for s in runs])
print("lengths chosen", {k: n - before.get(k, 0) for k, n in policy.num_chosen.items()})
for row in policy.costs.rows():
    if row["num_seqs"] in (1, 2, 4):
        print(row)
