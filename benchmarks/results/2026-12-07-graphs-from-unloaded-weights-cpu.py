"""Can a helper process build an engine's compiled step graphs without the weights? A process whose
parameters are never read from the checkpoint (they stay torch.empty: the loader's load_tensors is
replaced) starts a compiled engine on the bundled target with an empty compile cache; then a real
engine starts on that cache, and an eager one beside it. The real engine should load every graph,
compile none, and emit the eager engine's greedy tokens. --draft: the bundled pair, the draft's
weights not read either (its d2t zeros, a valid map), 4 held-out prompts, 32 tokens each.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \
        python benchmarks/results/2026-12-07-graphs-from-unloaded-weights-cpu.py FOLDER [--draft]
(FOLDER must not exist; the script runs itself once per engine, each in a process of its own.)
"""

import json
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60))]


def unloaded_draft(path, target, embed_tokens, dtype, aux_layer_offset=0):
    from warpspec.workers.models.eagle3_draft import Eagle3Config, Eagle3Draft

    draft = Eagle3Draft(Eagle3Config.from_pretrained(path, target, aux_layer_offset), embed_tokens, dtype)
    draft.d2t.zero_()
    return draft.eval()


def engine(mode: str, folder: str, with_draft: bool) -> None:
    from warpspec.entrypoints.llm import LLM
    from warpspec.sampling_params import SamplingParams
    from warpspec.spec_decode import methods
    from warpspec.workers import loader

    if mode == "unloaded":
        loader.load_tensors = lambda model, params, files, model_dir, after_file: 0
        methods.load_eagle3 = unloaded_draft
    draft = {"draft": "assets/tiny-maverick-eagle3"} if with_draft else {}
    start = time.perf_counter()
    llm = LLM("assets/tiny-maverick", dtype="float32", enforce_eager=mode == "eager", compile_cache=folder,
              run_dir=f"{folder}-run", **draft)
    report = {"mode": mode, "start_s": round(time.perf_counter() - start, 1),
              "phases": [(p.name, p.seconds, p.detail) for p in llm.startup]}
    if mode != "unloaded":
        prompts = json.loads(Path("assets/held_out_prompts.json").read_text())["prompt_token_ids"][:4] \
            if with_draft else PROMPTS
        params = SamplingParams(max_tokens=32 if with_draft else 24, temperature=0, ignore_eos=True)
        report["tokens"] = [o.token_ids for o in llm.generate(prompts, params)]
        if with_draft:
            report["accepted"] = llm.engine.spec_stats.num_accepted_tokens
    llm.shutdown()
    print("report:", json.dumps(report))


def main() -> None:
    folder = Path(sys.argv[1])
    assert not folder.exists(), f"{folder} exists: the helper must start on an empty compile cache"
    reports = {}
    for mode, cache in (("unloaded", folder), ("real", folder), ("eager", Path(f"{folder}-eager"))):
        result = subprocess.run([sys.executable, __file__, "--engine", mode, str(cache), *sys.argv[2:]],
                                capture_output=True, text=True, check=True)
        line = next(x for x in result.stdout.splitlines() if x.startswith("report: "))
        reports[mode] = json.loads(line[len("report: "):])
        print(mode, reports[mode]["start_s"], "s:", reports[mode]["phases"], "accepted:", reports[mode].get("accepted"))
    print("real engine's tokens == eager engine's:", reports["real"]["tokens"] == reports["eager"]["tokens"])


if __name__ == "__main__":
    if sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3], sys.argv[4:] == ["--draft"])
    else:
        main()
