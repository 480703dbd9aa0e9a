"""Which implementation of a kernel runs: the Triton version on CUDA tensors, the torch reference
elsewhere.

`WARPSPEC_KERNELS` overrides the choice:
- `reference`: always the torch reference (debugging a suspected kernel bug on a GPU);
- `triton`: always Triton, also on CPU tensors. Only useful with `TRITON_INTERPRET=1`, which runs
  Triton programs in the Python interpreter; the kernel tests use it to check every kernel on
  machines without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

MODES = ("auto", "reference", "triton")


def kernel_mode() -> str:
    mode = os.environ.get("WARPSPEC_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"WARPSPEC_KERNELS={mode!r} is not one of {', '.join(MODES)}")
    return mode


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """True when the op on x should run its Triton version."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        if not triton_available():
            raise RuntimeError("WARPSPEC_KERNELS=triton but triton is not installed (pip install triton)")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("WARPSPEC_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return x.is_cuda and triton_available()
