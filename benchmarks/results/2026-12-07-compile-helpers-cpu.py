"""A cold start with compile helpers against one without (workers/compile/compile_helpers.py), side by side.

Each start is a process of its own on an empty compile cache: the bundled pair (or the target alone
with --plain), float32, in process; then 4 held-out prompts x 32 greedy tokens. The rounds alternate
WARPSPEC_COMPILE_HELPERS=0 and the default, and the table gives each start's compile phases and
whether the tokens (and the drafts accepted) are the same.

OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \
    python benchmarks/results/2026-12-07-compile-helpers-cpu.py OUT [--rounds N] [--plain]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def start(folder: str, with_draft: bool) -> None:
    from warpspec.entrypoints.llm import LLM
    from warpspec.sampling_params import SamplingParams

    draft = {"draft": "assets/tiny-maverick-eagle3"} if with_draft else {}
    begin = time.perf_counter()
    llm = LLM("assets/tiny-maverick", dtype="float32", compile_cache=folder, run_dir=f"{folder}-run", **draft)
    report = {"start_s": round(time.perf_counter() - begin, 1),
              "phases": {p.name: [round(p.seconds, 1), p.detail] for p in llm.startup}}
    prompts = json.loads(Path("assets/held_out_prompts.json").read_text())["prompt_token_ids"][:4]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    report["tokens"] = [o.token_ids for o in outputs]
    report["accepted"] = llm.engine.spec_stats.num_accepted_tokens if with_draft else None
    llm.shutdown()
    print("report:", json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--plain", action="store_true", help="the target alone, no draft")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_ in range(args.rounds):
        for helpers in ("0", "default"):
            folder = out / f"cache-{round_}-{helpers}"
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(f"{folder}-run", ignore_errors=True)
            env = {k: v for k, v in os.environ.items() if k != "WARPSPEC_COMPILE_HELPERS"}
            if helpers == "0":
                env["WARPSPEC_COMPILE_HELPERS"] = "0"
            command = [sys.executable, __file__, "--start", str(folder), *(() if args.plain else ("--draft",))]
            result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            line = next(x for x in result.stdout.splitlines() if x.startswith("report: "))
            report = json.loads(line[len("report: "):])
            rows.append((round_, helpers, report))
            phases = report["phases"]
            print(f"round {round_} helpers={helpers}: start {report['start_s']} s, target "
                  f"{phases['compile target steps']}, draft {phases.get('compile draft steps')}, "
                  f"accepted {report['accepted']}", flush=True)
    reference = rows[0][2]["tokens"]
    print("\n| round | helpers | start s | compile target steps s | compile draft steps s | accepted | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for round_, helpers, report in rows:
        phases = report["phases"]
        draft = phases.get("compile draft steps", ["-"])[0]
        print(f"| {round_} | {helpers} | {report['start_s']} | {phases['compile target steps'][0]} | {draft} | "
              f"{report['accepted']} | {report['tokens'] == reference} |")


if __name__ == "__main__":
    if sys.argv[1] == "--start":
        start(sys.argv[2], "--draft" in sys.argv[3:])
    else:
        main()
