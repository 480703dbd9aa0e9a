"""A lone sequence's compiled decode step on 1 thread against 2, and what the eager timing that
picks the count (workers/compile/cpu_threads.py) sees, in one process. Run it under each OpenMP wait policy.

First the eager step of one sequence timed as an engine's start times it (fastest_thread_count), 4
times; then two runners of the checkpoint, one whose one-sequence graph is built with 1 thread and
one with 2, decoding one sequence 64 tokens in, 50 steps a run, the runs interleaved. The graphs go
to an inductor folder of this script's own (runs/one-sequence-threads), so that engines started
later do not take these builds' counts.

    [OMP_WAIT_POLICY=PASSIVE [GOMP_SPINCOUNT=10000]] \\
        python benchmarks/results/2026-12-06-one-sequence-threads-cpu.py CHECKPOINT RUNS
"""

import os

os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath("runs/one-sequence-threads")

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from warpspec.workers.compile.cpu_threads import fastest_thread_count  # noqa: E402
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig  # noqa: E402
from warpspec.workers.kv_cache import CacheConfig  # noqa: E402
from warpspec.workers.runner import ModelRunner  # noqa: E402
from warpspec.workers.step import SequenceStep, StepInput  # noqa: E402

BLOCK = 16
STEPS = 50
CONTEXT = 64


def runner_with(path: str, threads: int) -> ModelRunner:
    runner = ModelRunner(path, "float32", CacheConfig(block_size=BLOCK, num_blocks=512, hybrid=False),
                         cuda_graphs=CudaGraphConfig(batch_sizes=(1, 2, 4, 8), max_model_len=4096))
    warm_up = runner.graph_runner._warm_up_step(1, 1, [])
    runner.graph_runner.set_threads(warm_up, threads)
    runner.execute(warm_up)
    return runner


def main() -> None:
    path, runs = sys.argv[1], int(sys.argv[2])
    policy = " ".join(f"{name}={os.environ.get(name, '-')}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
    runners = {threads: runner_with(path, threads) for threads in (1, 2)}
    warm_up = runners[1].graph_runner._warm_up_step(1, 1, [])
    for _ in range(4):
        with torch.inference_mode():
            fastest, best = fastest_thread_count(lambda: runners[1]._eager_forward(warm_up))
        print(f"eager timing [{policy}]: fastest {fastest}, best ms "
              + ", ".join(f"{count} threads {seconds * 1e3:.3f}" for count, seconds in best.items()))
    table = list(range(-(-(CONTEXT + 40) // BLOCK)))
    prompt = torch.randint(3, 200, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    decode = StepInput.build([SequenceStep([5], CONTEXT, table, 0)], BLOCK)
    for runner in runners.values():
        runner.execute(StepInput.build([SequenceStep(prompt, 0, table, CONTEXT - 1)], BLOCK))
    ms: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(runs):
        for threads, runner in runners.items():
            start = time.perf_counter()
            for _ in range(STEPS):
                runner.execute(decode)
            ms[threads].append((time.perf_counter() - start) / STEPS * 1e3)
    one, two = statistics.median(ms[1]), statistics.median(ms[2])
    print(f"compiled [{policy}] {path}: 1 thread {one:.3f} ms ({min(ms[1]):.3f}-{max(ms[1]):.3f}), "
          f"2 threads {two:.3f} ms ({min(ms[2]):.3f}-{max(ms[2]):.3f}); 1 thread / 2 threads {one / two:.3f}")


if __name__ == "__main__":
    main()
