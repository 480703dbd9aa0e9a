"""Where one compiled decode step of the bundled target goes, by kind of kernel: torch.profiler with
inductor's per-kernel records (a compile cache of its own, since the records change the code), one
runner per dtype, every sequence at the same context.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 TORCHINDUCTOR_CACHE_DIR=runs/inductor-kernel-profile \\
        python benchmarks/results/2026-12-06-batch64-profile-cpu.py 64 96 float32,bfloat16
"""

import collections
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep, StepInput

inductor_config.cpp.enable_kernel_profile = True
BLOCK = 16
RUNS = 20


def kind(name: str) -> str:
    if name.startswith(("## Call", "Pregraph", "AOTDispatcher")):
        return "the graph's own code"
    if "mm_out" in name or "addmm" in name:
        return "GEMM"
    if "index_put" in name:
        return "attention: KV write, q/k/v gathered"
    if "softmax" in name:
        return "attention: scores, mask, softmax"
    if any(part in name for part in ("topk", "sigmoid", "bmm_clamp", "silu")):
        return "MoE routing, experts, MLP"
    return "other"


def main() -> None:
    batch, context, dtypes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    for dtype in dtypes:
        runner = ModelRunner("assets/tiny-maverick", dtype, CacheConfig(block_size=BLOCK, num_blocks=2048),
                             cuda_graphs=CudaGraphConfig(batch_sizes=(1, 2, 4, 8, 16, 32, 64), max_model_len=4096))
        runner.warm_up([])
        num_blocks = -(-(context + 8) // BLOCK)
        tables = [list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(batch)]
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 200, (context,), generator=generator).tolist() for _ in range(batch)]
        prefill = [SequenceStep(p, 0, t, context - 1) for p, t in zip(prompts, tables, strict=True)]
        runner.execute(StepInput.build(prefill, BLOCK))
        step = StepInput.build([SequenceStep([5], context, t, 0) for t in tables], BLOCK)
        for _ in range(5):
            runner.execute(step)
        start = time.perf_counter()
        for _ in range(RUNS):
            runner.execute(step)
        ms = (time.perf_counter() - start) / RUNS * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(RUNS):
                runner.execute(step)
        kinds: collections.Counter = collections.Counter()
        for event in prof.key_averages():
            kinds[kind(event.key)] += event.self_cpu_time_total
        total = sum(kinds.values())
        print(f"{dtype}, batch {batch}, context {context}: {ms:.2f} ms a step (not profiled)")
        for name, us in kinds.most_common():
            print(f"  {name:40s} {us / RUNS / 1e3:7.3f} ms  {100 * us / total:5.1f}%")


if __name__ == "__main__":
    main()
