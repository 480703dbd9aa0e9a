"""A hybrid KV cache against a full one at short context, one compiled decode step each, in one process:
the `small` preset with chunk 128 (6 layers, 1 NoPE: 6 KV groups of one layer, the most groups per
layer any layout has), block 16, float32, every sequence `context` tokens in. 50 steps a run, the runs
of the two runners interleaved; prints each one's median ms a step and the spread of the runs. A fourth
argument sets the number of layers: 8 (NoPE at 3 and 7) gives Maverick's layout, a full group and 3
chunked groups of 2 layers each.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \
        python benchmarks/results/2026-12-06-hybrid-short-context-cpu.py 8 64 30 [LAYERS]
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from warpspec.training.random_checkpoint import create_random_checkpoint
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import SequenceStep, StepInput

BLOCK = 16
CHUNK = 128
STEPS = 50


def step(runner: ModelRunner, seqs: list[SequenceStep]) -> StepInput:
    """seqs on runner's layout: each chunked group on blocks of its own, the full group's shifted by a
    group's share of the pool (as tests/steps.py builds them)."""
    layout = runner.kv_layout
    if layout.is_hybrid:
        stride = runner.num_blocks // len(layout.groups)
        groups = range(1, len(layout.groups))
        seqs = [SequenceStep(s.token_ids, s.num_cached, s.block_table, s.logits_from,
                             window_tables=[[b + g * stride for b in s.block_table] for g in groups])
                for s in seqs]
    return StepInput.build(seqs, BLOCK, chunk_size=layout.chunk_size)


def main() -> None:
    batch, context, runs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    layers = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    path = Path("runs/hybrid-short-context-c128" + ("" if layers == 6 else f"-l{layers}"))
    if not (path / "config.json").exists():
        create_random_checkpoint(path, "small", attention_chunk_size=CHUNK, max_position_embeddings=32768,
                                 num_hidden_layers=layers)
    runners = {}
    for hybrid in (True, False):
        runner = ModelRunner(path, "float32", CacheConfig(block_size=BLOCK, num_blocks=512, hybrid=hybrid),
                             cuda_graphs=CudaGraphConfig(batch_sizes=(1, 2, 4, 8), max_model_len=4096))
        runner.warm_up([])
        runners[hybrid] = runner
    num_blocks = -(-(context + 40) // BLOCK)
    tables = [list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(batch)]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (context,), generator=generator).tolist() for _ in range(batch)]
    decode = {}
    for hybrid, runner in runners.items():
        runner.execute(step(runner, [SequenceStep(p, 0, t, context - 1) for p, t in zip(prompts, tables, strict=True)]))
        decode[hybrid] = step(runner, [SequenceStep([5], context, t, 0) for t in tables])
    ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(runs):
        for hybrid, runner in runners.items():
            start = time.perf_counter()
            for _ in range(STEPS):
                runner.execute(decode[hybrid])
            ms[hybrid].append((time.perf_counter() - start) / STEPS * 1e3)
    print(f"{layers} layers, KV groups of the hybrid cache: {[g.layer_ids for g in runners[True].kv_layout.groups]}")
    for hybrid in (True, False):
        name = "hybrid" if hybrid else "full"
        print(f"{name}: batch {batch}, context {context}: {statistics.median(ms[hybrid]):.4f} ms a step "
              f"({min(ms[hybrid]):.4f}-{max(ms[hybrid]):.4f})")
    print(f"hybrid / full: {statistics.median(ms[True]) / statistics.median(ms[False]):.3f}")


if __name__ == "__main__":
    main()
