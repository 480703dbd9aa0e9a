"""Triton versions of the kernels in warpspec.kernels, one file per op family, each with the
signature of its torch reference. Imported only when `dispatch.use_triton` chooses them."""
