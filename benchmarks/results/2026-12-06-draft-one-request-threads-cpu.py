"""Batch 1 on the bundled pair, compiled, greedy: the draft's one-request graphs on the count the rule
gives (workers/cpu_threads.graph_thread_count: 2 threads on 2 cores with threads that spin) against 1
thread, the target's graphs as the rule gives in both. Both engines in one process; each round runs
the first 8 held-out prompts alone through each engine, 64 tokens each.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \
        python benchmarks/results/2026-12-06-draft-one-request-threads-cpu.py ROUNDS
"""

import json
import statistics
import sys
import time
from pathlib import Path

from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode import eagle3


def engine(draft_threads: int | None) -> LLM:
    rule = eagle3.graph_thread_count
    if draft_threads is not None:
        eagle3.graph_thread_count = lambda num_seqs, saved, timed: (draft_threads if num_seqs == 1
                                                                    else rule(num_seqs, saved, timed))
    try:
        llm = LLM("assets/tiny-maverick", dtype="float32", draft="assets/tiny-maverick-eagle3")
    finally:
        eagle3.graph_thread_count = rule
    print(f"draft graphs' threads ({'the rule' if draft_threads is None else draft_threads}):",
          llm.engine.proposer.graphs.thread_counts)
    return llm


def main() -> None:
    rounds = int(sys.argv[1])
    prompts = json.loads(Path("assets/held_out_prompts.json").read_text())["prompt_token_ids"][:8]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    engines = {"the rule": engine(None), "1 thread": engine(1)}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            for prompt in prompts:
                start = time.perf_counter()
                output = llm.generate([prompt], params)[0]
                rates[name].append(len(output.token_ids) / (time.perf_counter() - start))
    for name, values in rates.items():
        print(f"draft on {name}: median {statistics.median(values):.1f} tok/s "
              f"({min(values):.1f}-{max(values):.1f}), {len(values)} requests")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
