"""`warpspec bench compile`: what compiled steps cost at start-up, cold (an empty compile cache)
and warm (the cache a previous start left in the run folder), each in a fresh process, against
enforce_eager. A start is: build the engine, then run one short greedy request at batch 1 and one
at batch 2, so every decode (and, with the draft, verification) graph a small deployment needs
gets built. Reported: seconds from engine construction to the end of those requests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET

# Runs in a fresh interpreter, so nothing compiled by an earlier start stays in memory.
START = """
import json, sys, time
start = time.perf_counter()
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
target, draft, eager, run_dir = sys.argv[1], sys.argv[2] or None, sys.argv[3] == "1", sys.argv[4]
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
with LLM(target, dtype="float32", draft=draft, enforce_eager=eager, run_dir=run_dir) as llm:
    llm.generate([[1, 40, 41, 42]], params)
    llm.generate([[1, 40, 41, 42], [1, 50, 51]], params)
    runner = llm.engine.executor.runner.graph_runner
    compiles = runner.num_compiles if runner is not None else 0
print(json.dumps({"seconds": time.perf_counter() - start, "compiles": compiles}))
"""


def start_once(target: str, draft: str | None, eager: bool, run_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", START, target, draft or "", "1" if eager else "0", str(run_dir)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"a start failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench compile", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(BUNDLED_TARGET))
    parser.add_argument("--draft", default=str(BUNDLED_DRAFT))
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)  # a new run folder is fine, as elsewhere
    rows = []
    for name, draft in (("warpspec", None), ("warpspec + EAGLE-3 (k=3)", args.draft)):
        run_dir = Path(tempfile.mkdtemp(prefix="compile-", dir=Path(args.run_dir).resolve()))
        try:
            eager = start_once(args.target, draft, True, run_dir)
            cold = start_once(args.target, draft, False, run_dir)
            warm = start_once(args.target, draft, False, run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        rows.append({"system": name, "eager_s": eager["seconds"], "cold_s": cold["seconds"],
                     "warm_s": warm["seconds"], "target_graphs": cold["compiles"]})
        print(f"{name}: eager {eager['seconds']:.1f} s, cold {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s",
              flush=True)
    lines = ["| system | start, enforce_eager | start, compiled, cold cache | start, compiled, warm cache | "
             "target graphs |", "|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['eager_s']:.1f} s | {r['cold_s']:.1f} s | {r['warm_s']:.1f} s | "
              f"{r['target_graphs']} |" for r in rows]
    table = "\n".join(lines)
    print(f"\n{args.target}, float32, one rank; each start a fresh process\n\n{table}")
    out = Path(args.run_dir, "bench")
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "compile.md").write_text(table + "\n")
    return 0
