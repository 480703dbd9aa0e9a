"""Timing GPU work honestly: warm-up runs first (Triton compiles on first call), CUDA events around
each run, the median of many; on CPU the same loop with perf_counter."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Device memory bandwidth as a plain copy achieves it: bytes read + bytes written per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * num_bytes / ms / 1e6
