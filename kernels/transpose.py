"""A transposing copy of 2D CPU tensors for loading weights, about 1.5x as fast as torch's best.

A CPU model stores its routed experts input-major (workers/models/llama4.py, lay_out_inputs_contiguous), so
the loader writes every expert transposed from the checkpoint's layout: most of a MoE checkpoint's
bytes. torch has no fast transposing copy: `out.copy_(src.t())` walks the output element by element
with a strided read. Measured on 2 cores (a [1024, 2048] bf16 expert, 32 of them, torch 2.13):

| copy | GB/s |
|---|---|
| torch, one 2D copy (3D for all experts at once) | 1.06 (0.89) |
| torch, blocks of 256 source rows (the loader before this) | 2.85 |
| torch, 4D tiled views; numpy.copyto | 0.93; 0.48 |
| torch.compile of `out.copy_(src.t())` (10 s to compile, per process and shape) | 4.4-4.9 |
| C, element by element in 32 x 32 tiles, one thread | 1.5 |
| transpose.c (8 x 8 vector blocks), one thread / rows over two | 2.5 / 4.0-4.8 |
| (a plain copy, not transposed) | 11.5 |

transpose.c is built on first use with the host's C compiler (CC, else cc, gcc or clang) into a
per-user cache folder, keyed by its source and the compiler, and loaded with ctypes (which lets go of
the GIL during the call, so rows split over threads run in parallel). Where no compiler works,
`transpose` returns False and the caller keeps torch's copy.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("transpose.c")
TILE = 32  # transpose.c's tile: a thread's rows start on a tile
# Below this many elements one thread does the whole copy (a thread hand-off costs ~50 us).
PARALLEL_MIN_NUMEL = 1 << 20


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/warpspec, else ~/.cache/warpspec."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base, "warpspec")


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def library_name(source: bytes, compiler: str) -> str:
    """One name per source, compiler (path, size, modification time) and machine."""
    stat = os.stat(compiler)
    facts = [os.path.realpath(compiler), str(stat.st_size), str(stat.st_mtime_ns), platform.machine()]
    digest = hashlib.sha256(source + "\0".join(facts).encode()).hexdigest()[:16]
    return f"transpose-{digest}.so"


def build(compiler: str, out: Path) -> None:
    """Compile transpose.c to out, whole or not at all: a temporary name, then a rename, so that a
    process loading it meanwhile never sees half a library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        built = Path(scratch, out.name)
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(built), str(SOURCE)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, out)


@functools.cache
def library() -> ctypes.CDLL | None:
    """transpose.c, built once per host and loaded once per process; None (logged once) where it
    cannot be."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler (CC, cc, gcc, clang): weights load with torch's slower transposing copy")
        return None
    folders = [cache_dir(), Path(tempfile.gettempdir(), f"warpspec-{os.getuid()}")]
    name = library_name(SOURCE.read_bytes(), compiler)
    for folder in folders:
        path = folder / name
        try:
            if not path.is_file():
                build(compiler, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", None) or error
            logger.info("cannot build or load %s (%s)", path, detail)
            continue
        for size in (1, 2, 4, 8):
            fn = getattr(lib, f"warpspec_transpose_{size}")
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4
            fn.restype = None
        return lib
    logger.warning("transpose.c could not be built with %s in %s: weights load with torch's slower "
                   "transposing copy", compiler, ", ".join(map(str, folders)))
    return None


@functools.cache
def thread_pool(num_threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(num_threads, thread_name_prefix="warpspec-transpose")


def transpose(src: torch.Tensor, out: torch.Tensor) -> bool:
    """out[c, r] = src[r, c]: src [rows, cols] and out [cols, rows], CPU tensors of one dtype, each
    with unit stride along its rows (any row stride). Rows of src are split over torch's intra-op
    thread count. False, with nothing copied, where the library is not available or the tensors do
    not fit that description."""
    lib = library()
    if (lib is None or src.dim() != 2 or out.shape != src.shape[::-1] or src.dtype != out.dtype
            or src.device.type != "cpu" or out.device.type != "cpu"
            or (src.shape[1] > 1 and src.stride(1) != 1) or (out.shape[1] > 1 and out.stride(1) != 1)):
        return False
    if src.numel() == 0:
        return True
    fn = getattr(lib, f"warpspec_transpose_{src.element_size()}")
    rows, cols = src.shape
    num_threads = torch.get_num_threads() if src.numel() >= PARALLEL_MIN_NUMEL else 1
    tiles = -(-rows // TILE)
    bounds = [min(rows, TILE * (tiles * i // num_threads)) for i in range(num_threads + 1)]

    def rows_part(start: int, end: int) -> None:  # src[start:end] -> out[:, start:end]
        fn(src[start].data_ptr(), out[:, start].data_ptr(), end - start, cols, src.stride(0), out.stride(0))

    parts = [(start, end) for start, end in zip(bounds, bounds[1:], strict=False) if end > start]
    if len(parts) == 1:
        rows_part(*parts[0])
    else:
        for future in [thread_pool(num_threads).submit(rows_part, *part) for part in parts]:
            future.result()
    return True
