"""`warpspec bench spec`: speculative decoding against plain decoding, same checkpoint pair and
prompts, one run: tokens/s per user at several batch sizes, mean acceptance length, per-position
acceptance rate, and the draft's share of step time, at k drafts every step (speculative_policy
fixed). Greedy, so both runs emit the same tokens (checked)."""

from __future__ import annotations

import argparse
import time

from warpspec.benchmarks.report import write_report
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.spec_decode.speculation_stats import SpeculationStats


def _prompts(llm: LLM, batch: int, prompt_len: int) -> list[list[int]]:
    vocab = llm.engine.model_config.vocab_size
    return [[1, *[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len - 1)]] for i in range(batch)]


def measure(llm: LLM, prompts: list[list[int]], new_tokens: int, repeats: int,
            params: list[SamplingParams] | None = None) -> tuple[float, list[list[int]]]:
    """Tokens/s per user (median of repeats) and the tokens; params: per prompt, greedy by default."""
    params = params or SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm up, compile
    llm.engine.spec_stats = SpeculationStats()  # count the measured runs only
    walls, outs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        walls.append(time.perf_counter() - start)
    # Every request of the batch starts together and runs to new_tokens: per user, tokens / wall.
    return new_tokens / sorted(walls)[len(walls) // 2], [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench spec", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target checkpoint folder")
    parser.add_argument("--draft", required=True, help="EAGLE-3 draft checkpoint folder")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    rows = []
    k = args.num_speculative_tokens
    with LLM(args.target, dtype="float32") as plain, \
            LLM(args.target, dtype="float32", draft=args.draft, num_speculative_tokens=k,
                speculative_policy="fixed") as spec, \
            LLM(args.target, dtype="float32", draft=args.draft, num_speculative_tokens=k, compile_draft=False,
                speculative_policy="fixed") as eager:
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = _prompts(plain, batch, args.prompt_len)
            plain_rate, plain_tokens = measure(plain, prompts, args.new_tokens, args.repeats)
            spec_rate, spec_tokens = measure(spec, prompts, args.new_tokens, args.repeats)
            eager_rate, _ = measure(eager, prompts, args.new_tokens, args.repeats)
            stats = spec.engine.spec_stats
            rows.append({"batch": batch, "plain_tokens_per_s_per_user": plain_rate,
                         "spec_tokens_per_s_per_user": spec_rate, "speedup": spec_rate / plain_rate,
                         "acceptance_length": stats.acceptance_length,
                         "acceptance_rate_by_position": stats.acceptance_rate_at(),
                         "draft_share_of_step_time": stats.draft_share,
                         "eager_draft_tokens_per_s_per_user": eager_rate,
                         "eager_draft_share_of_step_time": eager.engine.spec_stats.draft_share,
                         "same_tokens": plain_tokens == spec_tokens})
    lines = [f"target {args.target}, draft {args.draft}, k={args.num_speculative_tokens}, greedy, "
             f"{args.new_tokens} new tokens, median of {args.repeats}\n",
             "| batch | plain tok/s/user | spec tok/s/user | speedup | acceptance length | accept rate by position "
             "| draft share of step (compiled / eager) | spec tok/s/user, eager draft | same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rates = " / ".join(f"{a:.2f}" for a in r["acceptance_rate_by_position"])
        lines.append(f"| {r['batch']} | {r['plain_tokens_per_s_per_user']:.1f} | {r['spec_tokens_per_s_per_user']:.1f} "
                     f"| {r['speedup']:.2f}x | {r['acceptance_length']:.2f} | {rates} "
                     f"| {r['draft_share_of_step_time']:.0%} / {r['eager_draft_share_of_step_time']:.0%} "
                     f"| {r['eager_draft_tokens_per_s_per_user']:.1f} | {r['same_tokens']} |")
    table = "\n".join(lines)
    print(table)
    write_report(args.run_dir, "spec", rows, table)
    return 0
