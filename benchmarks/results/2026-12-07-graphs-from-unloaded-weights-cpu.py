"""Can a helper process build an engine's compiled step graphs without the weights? A process whose
parameters are never read from the checkpoint (they stay torch.empty: the loader's load_tensors is
replaced) starts a compiled engine on the bundled target with an empty compile cache; then a real
engine starts on that cache, and an eager one beside it. The real engine should load every graph,
compile none, and emit the eager engine's greedy tokens.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \
        python benchmarks/results/2026-12-07-graphs-from-unloaded-weights-cpu.py FOLDER
(FOLDER must not exist; the script runs itself once per engine, each in a process of its own.)
"""

import json
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60))]


def engine(mode: str, folder: str) -> None:
    from warpspec.entrypoints.llm import LLM
    from warpspec.sampling_params import SamplingParams
    from warpspec.workers import loader

    if mode == "unloaded":
        loader.load_tensors = lambda params, files, config, model_dir, after_file: 0
    start = time.perf_counter()
    llm = LLM("assets/tiny-maverick", dtype="float32", enforce_eager=mode == "eager", compile_cache=folder,
              run_dir=f"{folder}-run")
    report = {"mode": mode, "start_s": round(time.perf_counter() - start, 1),
              "phases": [(p.name, p.seconds, p.detail) for p in llm.startup]}
    if mode != "unloaded":
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        report["tokens"] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    print("report:", json.dumps(report))


def main() -> None:
    folder = Path(sys.argv[1])
    assert not folder.exists(), f"{folder} exists: the helper must start on an empty compile cache"
    reports = {}
    for mode, cache in (("unloaded", folder), ("real", folder), ("eager", Path(f"{folder}-eager"))):
        result = subprocess.run([sys.executable, __file__, "--engine", mode, str(cache)], capture_output=True,
                                text=True, check=True)
        line = next(x for x in result.stdout.splitlines() if x.startswith("report: "))
        reports[mode] = json.loads(line[len("report: "):])
        print(mode, reports[mode]["start_s"], "s:", reports[mode]["phases"])
    print("real engine's tokens == eager engine's:", reports["real"]["tokens"] == reports["eager"]["tokens"])


if __name__ == "__main__":
    if sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3])
    else:
        main()
