"""The FP8 format that both quantizers write, the torch reference (fp8.py) and the Triton kernel
(triton/fp8.py): e4m3, scaled so that a row's largest entry lands on e4m3's largest finite value."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
# Rows whose amax is below this (all zeros, in practice) get this amax instead of a zero scale.
MIN_AMAX = 1e-12
