"""`warpspec bench dispatch`: what it costs to drive one step across N worker actors.

Control overhead per step = the coordinator's wall time for a step minus the slowest worker's own
compute time in it: what Ray adds (serialising the step, waking the workers, collecting replies).
Measured for Ray Compiled Graph dispatch and for plain actor calls, in the same run, on decode steps
of a small random checkpoint. Also: the engine's hop to the coordinator actor, and the cost of
encoding + decoding the msgpack step messages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from warpspec.llm import LLM
from warpspec.random_checkpoint import create_random_checkpoint
from warpspec.sampling_params import SamplingParams
from warpspec.workers.runner import StepOutput
from warpspec.workers.step import SequenceStep, StepInput


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_mode(model: Path, dispatch: str, num_workers: int, batch: int, new_tokens: int, run_dir: str) -> dict:
    with LLM(str(model), dtype="float32", num_workers=num_workers, executor="ray", dispatch=dispatch,
             run_dir=run_dir) as llm:
        executor = llm.engine.executor
        hop_s: list[float] = []
        execute = executor.execute

        def timed_execute(step):
            start = time.perf_counter()
            out = execute(step)
            hop_s.append(time.perf_counter() - start)
            return out

        executor.execute = timed_execute
        executor.record_timings()
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        prompts = [[1, *range(10 + i, 26 + i)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up
        executor.take_timings()
        hop_s.clear()
        llm.generate(prompts, params)
        timings = executor.take_timings()[1:]  # drop the prefill step: decode steps only
        hops = hop_s[1:]
    overhead = [t.overhead_s * 1e3 for t in timings]
    return {
        "dispatch": dispatch,
        "num_workers": num_workers,
        "steps": len(timings),
        "step_wall_ms_p50": statistics.median(t.wall_s * 1e3 for t in timings),
        "slowest_compute_ms_p50": statistics.median(t.slowest_compute_s * 1e3 for t in timings),
        "overhead_ms_p50": statistics.median(overhead),
        "overhead_ms_p90": _percentile(overhead, 0.9),
        # engine -> coordinator actor call, less the coordinator's own wall time for the step
        "engine_hop_ms_p50": statistics.median((h - t.wall_s) * 1e3 for h, t in zip(hops, timings, strict=True)),
    }


def measure_messages(batch: int, vocab: int, repeats: int = 2000) -> dict:
    step = StepInput.build([SequenceStep([7], 40 + i, list(range(i * 4, i * 4 + 4)), 0) for i in range(batch)], 16)
    output = StepOutput(torch.randn(batch, vocab), compute_s=0.001)
    start = time.perf_counter()
    for _ in range(repeats):
        StepInput.from_bytes(step.to_bytes())
    step_us = (time.perf_counter() - start) / repeats * 1e6
    start = time.perf_counter()
    for _ in range(repeats):
        StepOutput.from_bytes(output.to_bytes())
    output_us = (time.perf_counter() - start) / repeats * 1e6
    return {"step_input_us": step_us, "step_output_us": output_us, "batch": batch, "vocab": vocab}


def format_table(rows: list[dict], messages: dict) -> str:
    lines = [
        "| dispatch | workers | decode steps | step wall p50 (ms) | slowest worker compute p50 (ms) "
        "| control overhead p50 (ms) | overhead p90 (ms) | engine->coordinator hop p50 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['dispatch']} | {r['num_workers']} | {r['steps']} | {r['step_wall_ms_p50']:.2f} "
                     f"| {r['slowest_compute_ms_p50']:.2f} | {r['overhead_ms_p50']:.3f} | {r['overhead_ms_p90']:.3f} "
                     f"| {r['engine_hop_ms_p50']:.3f} |")
    if len(rows) == 2:
        lines.append(f"\ncompiled graph overhead / actor-call overhead: "
                     f"{rows[0]['overhead_ms_p50'] / rows[1]['overhead_ms_p50']:.2f}x")
    lines.append(f"msgpack encode+decode per step: StepInput ({messages['batch']} decoding sequences) "
                 f"{messages['step_input_us']:.0f} us, StepOutput ({messages['batch']} x {messages['vocab']} logits) "
                 f"{messages['step_output_us']:.0f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench dispatch", description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    model = Path(args.run_dir, "bench", "dispatch-model")
    if not (model / "config.json").exists():
        create_random_checkpoint(model, "tiny")
    rows = [measure_mode(model, mode, args.num_workers, args.batch, args.new_tokens, args.run_dir)
            for mode in ("compiled", "actor")]
    messages = measure_messages(args.batch, vocab=512)
    table = format_table(rows, messages)
    print(table)
    out = Path(args.run_dir, "bench", "dispatch.json")
    out.write_text(json.dumps({"rows": rows, "messages": messages}, indent=2) + "\n")
    Path(args.run_dir, "bench", "dispatch.md").write_text(table + "\n")
    print(f"\nwrote {out}")
    return 0
