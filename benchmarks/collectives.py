"""`warpspec bench collectives`: one all-reduce between CPU ranks of one host, over gloo (loopback
TCP) and over shared memory (workers/distributed/shm_comm.py), side by side in one run: the per-call time of
each backend for the rows a decode step, a verification, a batch-8 verification and a prompt chunk
reduce. Each rank runs one torch thread in a process of its own; Markdown and JSON under runs/bench/."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from warpspec.workers.distributed.comm import CommInit
from warpspec.workers.distributed.communicators import make_communicator
from warpspec.workers.worker import address_and_free_port

BACKENDS = ("gloo", "shm")


def _rank_main(rank: int, world_size: int, backend: str, port: int, rows: list[int], hidden: int, calls: int,
               results) -> None:
    torch.set_num_threads(1)
    comm = make_communicator(CommInit(backend, rank, world_size, "127.0.0.1", port))
    timings = {}
    for num_rows in rows:
        x = torch.randn(num_rows, hidden)
        for _ in range(calls // 10):  # warm up
            comm.all_reduce(x.clone())
        per_block = []
        for _ in range(5):  # the median of 5 blocks: a block is a few ms of a noisy machine
            start = time.perf_counter()
            for _ in range(calls // 5):
                comm.all_reduce(x.clone())
            per_block.append((time.perf_counter() - start) / (calls // 5))
        timings[num_rows] = statistics.median(per_block)
    if rank == 0:
        results[backend] = timings
    comm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpspec bench collectives", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256, help="the row width (the bundled target's hidden size)")
    parser.add_argument("--rows", default="1,4,32,512")
    parser.add_argument("--calls", type=int, default=2000, help="all-reduces timed per backend and row count")
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    results = mp.Manager().dict()
    for backend in BACKENDS:
        _, port = address_and_free_port()
        mp.start_processes(_rank_main, args=(args.ranks, backend, port, rows, args.hidden, args.calls, results),
                           nprocs=args.ranks, start_method="spawn")
    lines = [f"{args.ranks} ranks on this host, one torch thread each, float32 rows of {args.hidden}, "
             f"median of 5 blocks of {args.calls // 5} calls",
             "", "| rows | gloo (us per all-reduce) | shm (us per all-reduce) | gloo / shm |", "|---|---|---|---|"]
    for num_rows in rows:
        gloo, shm = results["gloo"][num_rows] * 1e6, results["shm"][num_rows] * 1e6
        lines.append(f"| {num_rows} | {gloo:.1f} | {shm:.1f} | {gloo / shm:.1f}x |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.run_dir, "bench")
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.md").write_text(table + "\n")
    (out / "collectives.json").write_text(json.dumps({"ranks": args.ranks, "hidden": args.hidden,
                                                      "seconds_per_all_reduce": dict(results)}, indent=2))
    print(f"\nwrote {out}/collectives.md, collectives.json")
    return 0
