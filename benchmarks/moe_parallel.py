"""`warpspec bench moe`: routed experts split by width over every rank (moe_parallel="tensor") vs
whole experts per rank ("expert"), on one target, side by side:

- end to end over N Ray workers: tokens/s per user at several batch sizes (greedy; both modes must
  emit the same tokens);
- each rank's routed-expert time per decode step: the MoE inputs of a real decode step are captured
  in-process, then every rank's share of the experts, as the loader gives it that rank (its width
  slices, or its whole experts), is timed on them. The slowest rank is the step's critical path;
  max / mean is the imbalance.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from warpspec.assets import BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks.report import write_report
from warpspec.entrypoints.llm import LLM
from warpspec.kernels import moe_experts, route_topk_sigmoid
from warpspec.sampling_params import SamplingParams
from warpspec.workers.distributed.comm import Communicator
from warpspec.workers.loader import load_model
from warpspec.workers.models.llama4 import Llama4MoE

MODES = ("tensor", "expert")


def _prompts(batch: int) -> list[list[int]]:
    prompts = held_out_prompts()
    return [prompts[i % len(prompts)] for i in range(batch)]


def end_to_end(target: str, num_workers: int, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    rows, tokens_of = [], {}
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for mode in MODES:
        with LLM(target, dtype="float32", num_workers=num_workers, moe_parallel=mode) as llm:
            llm.generate(_prompts(2), SamplingParams(max_tokens=4, temperature=0))  # warm up
            for batch in tqdm(batches, desc=f"{mode}, {num_workers} workers"):
                walls = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    outs = llm.generate(_prompts(batch), params)
                    walls.append(time.perf_counter() - start)
                tokens_of[mode, batch] = [o.token_ids for o in outs]
                rate = new_tokens / statistics.median(walls)
                rows.append({"mode": mode, "batch": batch, "tokens_per_s_per_user": rate})
    for row in rows:
        row["same_tokens_as_tensor"] = tokens_of[row["mode"], row["batch"]] == tokens_of["tensor", row["batch"]]
    return rows


def capture_moe_inputs(target: str, batch: int) -> list[tuple[Llama4MoE, torch.Tensor]]:
    """Each MoE layer with its input in the decode step after a prefill of `batch` prompts."""
    captured: list[tuple[Llama4MoE, torch.Tensor]] = []
    with LLM(target, dtype="float32") as llm:
        moes = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, Llama4MoE)]
        hooks = [m.register_forward_pre_hook(lambda m, args: captured.append((m, args[0].clone()))) for m in moes]
        llm.generate(_prompts(batch), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        for hook in hooks:
            hook.remove()
    return captured[-len(moes):]  # the decode step: one token per sequence


def rank_experts(target: str, mode: str, rank: int, num_workers: int) -> list[Llama4MoE]:
    """Rank's MoE layers as the loader builds them under mode (its slices of every expert, or its
    whole experts), loaded in-process: no collective runs while loading."""
    model = load_model(target, "float32", comm=Communicator(rank, num_workers), moe_parallel=mode)
    return [m for m in model.modules() if isinstance(m, Llama4MoE)]


def expert_times(target: str, num_workers: int, batches: list[int], repeats: int) -> list[dict]:
    rows = []
    for batch in batches:
        layers = capture_moe_inputs(target, batch)
        work = {}  # (mode, rank) -> per layer (x, the rank's experts, expert_ids, scores)
        for mode in MODES:
            for rank in range(num_workers):
                shards = rank_experts(target, mode, rank, num_workers)
                work[mode, rank] = [(x, shard.experts, *route_topk_sigmoid(moe.router(x), moe.top_k))
                                    for (moe, x), shard in zip(layers, shards, strict=True)]
        samples: dict[tuple[str, int], list[float]] = {key: [] for key in work}
        for _ in range(repeats):  # round robin, so that drift on a busy machine hits every share alike
            for key, layer_work in work.items():
                start = time.perf_counter()
                for x, experts, expert_ids, scores in layer_work:
                    moe_experts(x, experts.gate_up_proj, experts.down_proj, expert_ids, scores,
                                first_expert=experts.first_expert)
                samples[key].append(time.perf_counter() - start)
        for mode in MODES:
            per_rank = [statistics.median(samples[mode, rank]) * 1e3 for rank in range(num_workers)]
            rows.append({"mode": mode, "batch": batch, "rank_ms": per_rank, "slowest_ms": max(per_rank),
                         "imbalance": max(per_rank) / statistics.mean(per_rank)})
    return rows


def tables(results: dict, num_workers: int) -> str:
    lines = [f"End to end, {num_workers} Ray workers, greedy:", "",
             "| batch | tensor tok/s/user | expert tok/s/user | tensor / expert | same tokens |",
             "|---|---|---|---|---|"]
    by = {(r["mode"], r["batch"]): r for r in results["end_to_end"]}
    for batch in sorted({r["batch"] for r in results["end_to_end"]}):
        tensor, expert = by["tensor", batch]["tokens_per_s_per_user"], by["expert", batch]["tokens_per_s_per_user"]
        lines.append(f"| {batch} | {tensor:.1f} | {expert:.1f} | {tensor / expert:.2f}x "
                     f"| {by['expert', batch]['same_tokens_as_tensor']} |")
    lines += ["", "Routed experts per decode step, each rank's share (ms, all MoE layers):", "",
              "| batch | mode | per rank | slowest | max / mean |", "|---|---|---|---|---|"]
    for r in results["expert_times"]:
        ranks = " / ".join(f"{ms:.3f}" for ms in r["rank_ms"])
        lines.append(f"| {r['batch']} | {r['mode']} | {ranks} | {r['slowest_ms']:.3f} | {r['imbalance']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench moe", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--expert-repeats", type=int, default=200, help="timed passes over each rank's experts")
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = {"end_to_end": end_to_end(args.target, args.num_workers, batches, args.new_tokens, args.repeats),
               "expert_times": expert_times(args.target, args.num_workers, batches, args.expert_repeats)}
    table = tables(results, args.num_workers)
    print(f"target {args.target}, float32\n\n{table}")
    write_report(args.run_dir, "moe", results, table)
    return 0
