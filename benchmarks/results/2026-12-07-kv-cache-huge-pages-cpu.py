"""Tried and dropped: a CPU KV cache zeroed on transparent huge pages (advised MADV_HUGEPAGE before it
is written, as the loader advises parameters: workers/loader.advise_huge_pages) against torch.zeros,
in one process, rounds alternating:
1. making the cache alone, 1 and 4 GiB in tensors of 128 MiB (a layer's);
2. the start of an engine on the bundled pair with the draft (eager, the default 1 GiB cache), the
   target's cache made either way (the runner's allocate_kv_cache);
3. that engine's decode at batch 8 after 400-token prompts.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 python benchmarks/results/2026-12-07-kv-cache-huge-pages-cpu.py ROUNDS
"""

import contextlib
import gc
import statistics
import sys
import time

import torch
from torch import nn

from warpspec.entrypoints.llm import LLM
from warpspec.sampling_params import SamplingParams
from warpspec.workers import runner
from warpspec.workers.loader import advise_huge_pages

LAYER = 128 << 20
NAMES = ("huge pages", "torch.zeros")


def huge_zeros(shape, dtype, device) -> torch.Tensor:
    holder = nn.Module()
    holder.cache = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    advise_huge_pages(holder)
    return holder.cache.data.zero_()


def torch_zeros(shape, dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


ZEROS = {"huge pages": huge_zeros, "torch.zeros": torch_zeros}


@contextlib.contextmanager
def kv_caches_made_by(name: str):
    allocate = runner.allocate_kv_cache

    def made(config, num_kv_heads, num_blocks, block_size, dtype, device, num_tensors=None):
        shape = (2, num_blocks, block_size, num_kv_heads, config.head_dim)
        return [ZEROS[name](shape, dtype, device) for _ in range(num_tensors or config.num_hidden_layers)]

    runner.allocate_kv_cache = made
    try:
        yield
    finally:
        runner.allocate_kv_cache = allocate


def report(title: str, times: dict[str, list[float]], unit: str = "ms", scale: float = 1e3) -> None:
    print(title)
    for name, values in times.items():
        print(f"  {name:12s} median {statistics.median(values) * scale:8.1f} {unit} "
              f"({min(values) * scale:.1f}-{max(values) * scale:.1f}), {len(values)} runs")
    old, new = (statistics.median(times[n]) for n in ("torch.zeros", "huge pages"))
    print(f"  torch.zeros / huge pages: {old / new:.2f}x")


def main() -> None:
    rounds = int(sys.argv[1])
    for gib in (1, 4):
        times: dict[str, list[float]] = {n: [] for n in NAMES}
        for _ in range(rounds):
            for name in NAMES:
                gc.collect()
                start = time.perf_counter()
                tensors = [ZEROS[name]((LAYER // 4,), torch.float32, "cpu") for _ in range(gib * 8)]
                times[name].append(time.perf_counter() - start)
                del tensors
        report(f"{gib} GiB in {gib * 8} tensors of 128 MiB", times)

    starts: dict[str, list[float]] = {n: [] for n in NAMES}
    phases: dict[str, dict[str, list[float]]] = {n: {} for n in NAMES}
    rates: dict[str, list[float]] = {n: [] for n in NAMES}
    prompts = [[3 + (7 * i + j) % 500 for j in range(400)] for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for _ in range(rounds):
        for name in NAMES:
            with kv_caches_made_by(name):
                gc.collect()
                start = time.perf_counter()
                llm = LLM("assets/tiny-maverick", dtype="float32", draft="assets/tiny-maverick-eagle3",
                          enforce_eager=True)
                starts[name].append(time.perf_counter() - start)
                for phase in llm.startup:
                    phases[name].setdefault(phase.name, []).append(phase.seconds)
                llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # the first request's one-offs
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                rates[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
                llm.shutdown()
                del llm
    report("engine start, bundled pair with the draft, eager", starts, "s", 1)
    for phase in phases["huge pages"]:
        report(f"  start-up phase: {phase}", {n: phases[n][phase] for n in NAMES}, "s", 1)
    print("batch 8, 400-token prompts, 32 tokens each (tok/s)")
    for name, values in rates.items():
        print(f"  {name:12s} median {statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
