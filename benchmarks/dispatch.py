"""`warpspec bench dispatch`: what it costs to drive one step of a replica on Ray workers.

The engine core runs its own step loop in the coordinator actor; the replica sends requests
fire-and-forget and reads one reply per step from a stream. Per decode step, from the coordinator's
own clock and the replica's:
- dispatch overhead: the coordinator's wall time for the workers' step minus the slowest worker's
  own compute (what Ray adds: serialising the step, waking the workers, collecting replies);
- host overhead: the whole core step minus the slowest worker's compute (scheduling, dispatch,
  sampling or verification, the draft, bookkeeping): everything the workers do not do;
- stream lag: from the core sending a step's reply to the replica holding it (same node, monotonic
  clock). The core does not wait for it: its next step is already running;
- bytes per step across each boundary: replica -> core and back (pickled, as Ray sends them),
  core -> each of ranks 1..N-1 (the msgpack step) and back. The coordinator is rank 0: its logits
  and hidden states cross no boundary.
Measured for Ray Compiled Graph dispatch and for plain actor calls on a small random checkpoint, and
with the bundled EAGLE-3 pair, in one run. The EAGLE-3 replica chooses its draft length per step
(speculative_policy adaptive), and the table of step costs it chooses from is printed too.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path

from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.training.random_checkpoint import create_random_checkpoint
from warpspec.workers.step import SequenceStep, StepInput


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_mode(label: str, model: Path, dispatch: str, num_workers: int, batch: int, new_tokens: int,
                 run_dir: str, draft: Path | None = None) -> dict:
    speculation = {} if draft is None else {"draft": str(draft), "speculative_policy": "adaptive"}
    with LLM(str(model), dtype="float32", num_workers=num_workers, executor="ray", dispatch=dispatch,
             run_dir=run_dir, compile_draft=False, **speculation) as llm:
        coordinator = llm.engine.coordinator
        sent: list[int] = []  # bytes of each message to the core
        replies: list[tuple[float, int]] = []  # (stream lag s, bytes) per reply
        submit, next_reply = coordinator.submit, coordinator.next_reply

        def timed_submit(message):
            sent.append(len(pickle.dumps(message)))
            submit(message)

        def timed_next_reply():
            reply = next_reply()
            replies.append((time.monotonic() - reply.sent_at, len(pickle.dumps(reply))))
            return reply

        coordinator.submit, coordinator.next_reply = timed_submit, timed_next_reply
        coordinator.record_timings()
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        prompts = [[1, *range(10 + i, 26 + i)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm up
        coordinator.take_timings()
        sent.clear()
        replies.clear()
        llm.generate(prompts, params)
        timings = coordinator.take_timings()[1:]  # drop the prefill step: decode steps only
        replies = replies[1:]  # likewise
        step_costs = llm.engine.stats().step_costs
    host = [(t.core_s - t.slowest_compute_s) * 1e3 for t in timings]
    return {
        "label": label,
        "dispatch": dispatch,
        "num_workers": num_workers,
        "steps": len(timings),
        "step_wall_ms_p50": statistics.median(t.wall_s * 1e3 for t in timings),
        "slowest_compute_ms_p50": statistics.median(t.slowest_compute_s * 1e3 for t in timings),
        "dispatch_overhead_ms_p50": statistics.median((t.wall_s - t.slowest_compute_s) * 1e3 for t in timings),
        "host_overhead_ms_p50": statistics.median(host),
        "host_overhead_ms_p90": _percentile(host, 0.9),
        "stream_lag_ms_p50": statistics.median(lag * 1e3 for lag, _ in replies),
        "replica_to_core_messages": len(sent),  # in the whole measured generate call
        "replica_to_core_bytes_p50": statistics.median(sent),
        "core_to_replica_bytes_p50": statistics.median(size for _, size in replies),
        "core_to_worker_bytes_p50": statistics.median(t.step_bytes for t in timings),
        "rank1_to_core_bytes_p50": statistics.median(t.reply_bytes for t in timings),
        "step_costs": [list(row) for row in step_costs],
    }


def measure_messages(batch: int, repeats: int = 2000) -> dict:
    step = StepInput.build([SequenceStep([7], 40 + i, list(range(i * 4, i * 4 + 4)), 0) for i in range(batch)], 16)
    start = time.perf_counter()
    for _ in range(repeats):
        StepInput.from_bytes(step.to_bytes())
    return {"step_input_us": (time.perf_counter() - start) / repeats * 1e6, "batch": batch}


def format_table(rows: list[dict], messages: dict) -> str:
    lines = [
        "| replica | dispatch | workers | decode steps | step wall p50 (ms) | slowest worker compute p50 (ms) "
        "| dispatch overhead p50 (ms) | host overhead p50 / p90 (ms) | stream lag p50 (ms) "
        "| messages replica->core (bytes p50) | bytes core->replica per step "
        "| bytes core->rank 1 / rank 1->core |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['label']} | {r['dispatch']} | {r['num_workers']} | {r['steps']} "
                     f"| {r['step_wall_ms_p50']:.2f} | {r['slowest_compute_ms_p50']:.2f} "
                     f"| {r['dispatch_overhead_ms_p50']:.3f} "
                     f"| {r['host_overhead_ms_p50']:.3f} / {r['host_overhead_ms_p90']:.3f} "
                     f"| {r['stream_lag_ms_p50']:.3f} "
                     f"| {r['replica_to_core_messages']} ({r['replica_to_core_bytes_p50']:.0f}) "
                     f"| {r['core_to_replica_bytes_p50']:.0f} "
                     f"| {r['core_to_worker_bytes_p50']:.0f} / {r['rank1_to_core_bytes_p50']:.0f} |")
    lines.append(f"msgpack encode+decode of the step sent to ranks 1..N-1 ({messages['batch']} decoding sequences): "
                 f"{messages['step_input_us']:.0f} us")
    for r in rows:
        if r["step_costs"]:
            lines += ["", f"The step cost model of {r['label']} (ms; target: tokens per sequence, draft: drafts per "
                      "request, host: the rest of a step), which its adaptive draft length reads:",
                      step_costs_table(r["step_costs"])]
    return "\n".join(lines)


def step_costs_table(step_costs: list[list]) -> str:
    """EngineStats.step_costs as one row per (step, length) and a column per batch size."""
    sizes = sorted({num_seqs for _, num_seqs, _, _ in step_costs})
    cells: dict[tuple[str, int], dict[int, float]] = {}
    for step, num_seqs, length, ms in step_costs:
        cells.setdefault((step, length), {})[num_seqs] = ms
    lines = ["| step | length | " + " | ".join(f"batch {n}" for n in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for (step, length), by_size in cells.items():
        lines.append(f"| {step} | {length} | " + " | ".join(f"{by_size[n]:.2f}" if n in by_size else "-"
                                                          for n in sizes) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench dispatch", description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--run-dir", default="runs")
    parser.add_argument("--no-draft", action="store_true", help="skip the bundled EAGLE-3 pair")
    args = parser.parse_args(argv)
    model = Path(args.run_dir, "bench", "dispatch-model")
    if not (model / "config.json").exists():
        create_random_checkpoint(model, "tiny")
    rows = [measure_mode("tiny", model, mode, args.num_workers, args.batch, args.new_tokens, args.run_dir)
            for mode in ("compiled", "actor")]
    if not args.no_draft:
        from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET

        rows.append(measure_mode("bundled + EAGLE-3", BUNDLED_TARGET, "compiled", args.num_workers, args.batch,
                                 args.new_tokens, args.run_dir, draft=BUNDLED_DRAFT))
    messages = measure_messages(args.batch)
    table = format_table(rows, messages)
    print(table)
    out = Path(args.run_dir, "bench", "dispatch.json")
    out.write_text(json.dumps({"rows": rows, "messages": messages}, indent=2) + "\n")
    Path(args.run_dir, "bench", "dispatch.md").write_text(table + "\n")
    print(f"\nwrote {out}")
    return 0
