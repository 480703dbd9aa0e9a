"""ms a decode step of the bundled target, compiled, by batch size: the script behind
2026-12-06-omp-spin-cpu.md, as it ran (argv: a label, the batch sizes; the OpenMP settings come from
the environment, e.g. `OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 python ... spin 2,8,64`)."""
import statistics
import sys
import time

from warpspec.assets import BUNDLED_TARGET, held_out_prompts
from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams

prompts = held_out_prompts()
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
with LLM(str(BUNDLED_TARGET), dtype="float32", enable_prefix_caching=False, enforce_eager=False,
         run_dir="runs") as llm:
    llm.generate(prompts[:2], params)
    for b in [int(x) for x in sys.argv[2].split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            llm.generate(batch, params)
            runs.append(time.perf_counter() - start)
        print(sys.argv[1], b, "ms/step", round(statistics.median(runs) / 128 * 1e3, 2), [round(x, 2) for x in runs],
              flush=True)
