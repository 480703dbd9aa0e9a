"""`warpspec bench gpu_check` (or `make gpu-check`): the GPU path in one run, reported as JSON and
Markdown. 1) every Triton kernel against its torch reference: error and time; 2) bandwidth that
decode attention and the small-batch MoE achieve against a plain copy; 3) one simulated Maverick
rank in FP8 with CUDA graphs: decode and 4-token verify at batch 1 and 8, the bytes each step must
read and the time floor they imply; 4) the EAGLE-3 draft at Maverick's width, timed per speculative
step; and a projection of tokens/s per user on 8 GPUs that counts the rank, its all-reduces, the
engine's host time per step and the draft. `--profile` adds the top 15 kernels of one eager decode
step at batch 1 of each simulated layout (torch.profiler; CPU ops under --tiny).

On one H200 it finishes in a few minutes. `--tiny` shrinks every shape so the same code runs on a
CPU (Triton under its interpreter, the model on the torch references): the tests run it that way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

# The acceptance length measured on the bundled tiny-maverick pair (assets/MODEL_CARD.md); a Maverick
# draft's own figure replaces it when known.
DEFAULT_ACCEPTANCE = 2.89
# One-shot all-reduce of a few KB over NVLink (TensorRT-LLM's custom kernel class); NCCL's ring is
# slower at this size, hence the sweep in the report.
DEFAULT_ALLREDUCE_US = 8.0
# The engine's host time per step outside the slowest rank's compute, p50: `warpspec bench dispatch`
# (2 workers, 8 decoding sequences, the 2-core CPU machine, 2026-12-01). Pass the GPU host's own.
DEFAULT_HOST_MS = 0.594


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes, runs on a CPU in minutes")
    parser.add_argument("--out", default="runs/gpu_check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (median)")
    parser.add_argument("--allreduce-us", type=float, default=DEFAULT_ALLREDUCE_US)
    parser.add_argument("--acceptance-length", type=float, default=DEFAULT_ACCEPTANCE)
    parser.add_argument("--host-ms", type=float, default=DEFAULT_HOST_MS,
                        help="the engine's host time per step (warpspec bench dispatch's host overhead p50)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="k, the draft length")
    parser.add_argument("--skip-simulation", action="store_true", help="kernels and bandwidth only")
    parser.add_argument("--profile", action="store_true",
                        help="the top kernels of one decode step of the simulated rank (torch.profiler)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.tiny:
            parser.error("no GPU here: use --tiny to run the check on the CPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    from warpspec.benchmarks import kernel_check, maverick_draft, maverick_rank
    from warpspec.benchmarks.timing import copy_bandwidth_gbs

    repeats = args.repeats or (3 if args.tiny else 50)
    started = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                    or "cpu", "device_type": device.type, "tiny": args.tiny, "torch": torch.__version__,
                    "repeats": repeats, "errors": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def checkpoint(part: str) -> None:
        """A killed or hung run (the device's time is short) still leaves every part that finished."""
        report["wall_s"] = time.perf_counter() - started
        (out / "gpu_check.partial.json").write_text(json.dumps(report, indent=2))
        memory = f", {torch.cuda.memory_allocated(device) / 1e9:.1f} GB allocated" if device.type == "cuda" else ""
        print(f"gpu_check: {part} done at {report['wall_s']:.0f} s{memory}", flush=True)

    copy_gbs = copy_bandwidth_gbs(device, (1 << 20) if args.tiny else (4 << 30), repeats)
    report["copy_bandwidth_gbs"] = copy_gbs
    results = kernel_check.run_kernel_checks(device, args.tiny, repeats)
    report["kernels"] = kernel_check.as_dicts(results)
    report["bandwidth"] = kernel_check.bandwidth_rows(results, copy_gbs)
    checkpoint("kernels")
    if not args.skip_simulation:
        shape = maverick_rank.RankShape.tiny() if args.tiny else maverick_rank.RankShape()
        report["simulation"] = []
        if args.profile:
            report["profile"] = {}
        for layout in ("tensor", "expert"):  # one rank model at a time: each holds the whole rank's experts
            try:
                simulation = maverick_rank.run_simulation(replace(shape, moe_parallel=layout), device,
                                                          max(3, repeats // 5), profile=args.profile)
                report["simulation"] += simulation["rows"]
                if args.profile:
                    report["profile"][layout] = simulation["profile"]
            except Exception as e:  # report what ran; a failure here must not lose parts 1 and 2
                report["errors"].append(f"simulation ({layout}): {type(e).__name__}: {str(e)[:500]}")
            # Both layouts' models do not fit at once. The first --profile run on an H200 (2026-12-04)
            # still held the tensor layout's model when the expert one was built (out of memory);
            # collecting here, with the profile taken before the graphs, fixed it.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            checkpoint(f"simulation ({layout})")
        draft_shape = maverick_draft.DraftShape.tiny() if args.tiny else maverick_draft.DraftShape()
        try:
            report["draft"] = maverick_draft.run_draft_simulation(draft_shape, device, max(3, repeats // 5),
                                                                  args.num_speculative_tokens)
        except Exception as e:  # the projection then counts no draft time, and says so
            report["draft"] = []
            report["errors"].append(f"draft simulation: {type(e).__name__}: {str(e)[:500]}")
        draft_ms = {row["batch"]: row["draft_ms"] for row in report["draft"]}
        report["projection"] = {
            f"{us:g}us": maverick_rank.project(report["simulation"], copy_gbs, shape.num_layers, us,
                                               args.acceptance_length, args.host_ms, draft_ms)
            for us in sorted({args.allreduce_us, 5.0, 20.0})}
    report["acceptance_length"] = args.acceptance_length
    report["allreduce_us"] = args.allreduce_us
    report["host_ms"] = args.host_ms
    report["wall_s"] = time.perf_counter() - started
    (out / "gpu_check.partial.json").unlink(missing_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    markdown = render(report)
    (out / "gpu_check.md").write_text(markdown)
    print(markdown)
    return 0 if all(k["passed"] for k in report["kernels"]) and not report["errors"] else 1


def render(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}{' (tiny shapes)' if report['tiny'] else ''}", "",
             f"torch {report['torch']}, median of {report['repeats']} runs, wall {report['wall_s']:.0f} s; "
             f"copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s (read + write)", "",
             "| kernel | relative error | tolerance | pass | triton ms | torch reference ms | speedup |",
             "|---|---|---|---|---|---|---|"]
    for k in report["kernels"]:
        if k["error"]:
            lines.append(f"| {k['name']} | failed: {k['error']} | {k['tolerance']:g} | False | | | |")
            continue
        lines.append(f"| {k['name']} | {k['relative_error']:.3g} | {k['tolerance']:g} | {k['passed']} | "
                     f"{k['triton_ms']:.4f} | {k['reference_ms']:.4f} | {k['speedup']:.2f}x |")
    lines += ["", "| memory-bound kernel | bytes | ms | timed | GB/s | fraction of copy bandwidth |",
              "|---|---|---|---|---|---|"]
    for b in report["bandwidth"]:
        lines.append(f"| {b['kernel']} | {b['bytes']:,} | {b['triton_ms']:.4f} | {b.get('timed', 'eager')} "
                     f"| {b['achieved_gbs']:.0f} | {b['fraction_of_copy']:.0%} |")
    if "simulation" in report:
        lines += ["", "One Maverick rank of 8 (FP8 weights), routed experts split by width over the 8 ranks "
                  "(tensor) or 16 whole ones per rank (expert, the busiest rank: every token routed to its experts):",
                  "", "| experts | batch | tokens/seq | eager ms | CUDA graph ms | MB read "
                  "| floor ms at copy bandwidth |", "|---|---|---|---|---|---|---|"]
        for r in report["simulation"]:
            graph = f"{r['graph_ms']:.3f}" if "graph_ms" in r else r.get("graph_error", "n/a (CPU)")
            floor = r["total_gb"] / report["copy_bandwidth_gbs"] * 1e3
            lines.append(f"| {r['moe_parallel']} | {r['batch']} | {r['query_len']} | {r['eager_ms']:.3f} | {graph} | "
                         f"{r['total_gb'] * 1e3:,.1f} | {floor:.3f} |")
        lines += ["", "The EAGLE-3 draft (bf16, Maverick's width, unsharded beside rank 0) per speculative step: a "
                  "catch-up forward over k+1 tokens a sequence, then k-1 forwards of one:", "",
                  "| batch | catch-up ms | one-token forward ms | draft ms per step |", "|---|---|---|---|"]
        for d in report["draft"]:
            lines.append(f"| {d['batch']} | {d['catch_up_ms']:.3f} | {d['single_token_ms']:.3f} "
                         f"| {d['draft_ms']:.3f} |")
        lines += ["", f"Projection on 8 GPUs: a step is the rank's time + 2 all-reduces x layers at the stated latency "
                  f"+ {report['host_ms']} ms of host time (`warpspec bench dispatch`) + the draft's time on a verify "
                  f"step, which yields {report['acceptance_length']} tokens (acceptance length); a decode step "
                  "yields 1.", "",
                  "| all-reduce latency | experts | batch | tokens/seq | rank ms | all-reduce ms | host ms | draft ms "
                  "| step ms | tokens/s per user |", "|---|---|---|---|---|---|---|---|---|---|"]
        for latency, rows in report["projection"].items():
            for p in rows:
                lines.append(f"| {latency} | {p['moe_parallel']} | {p['batch']} | {p['query_len']} "
                             f"| {p['rank_ms']:.3f} | {p['allreduce_ms']:.3f} | {p['host_ms']:.3f} "
                             f"| {p['draft_ms']:.3f} | {p['step_ms']:.3f} | {p['tok_s_per_user']:.0f} |")
    for layout, rows in report.get("profile", {}).items():
        lines += ["", f"Top kernels of one eager decode step at batch 1, {layout} layout (torch.profiler; "
                  f"{'device' if report.get('device_type') == 'cuda' else 'CPU'} time):", "",
                  "| kernel | calls | total ms | fraction of step |", "|---|---|---|---|"]
        for p in rows:
            name = p["name"].replace("|", "/")[:100]  # C++ template names run to hundreds of characters
            lines.append(f"| {name} | {p['calls']} | {p['total_ms']:.3f} | {p['fraction']:.1%} |")
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
