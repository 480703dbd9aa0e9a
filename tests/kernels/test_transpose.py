"""kernels/transpose.py: the C transposing copy against torch's, and its build."""

import logging

import pytest
import torch

from warpspec.kernels import transpose as transpose_module
from warpspec.kernels.transpose import transpose

# Edges on both sides of the 8 x 8 (2-byte) and 4 x 4 (4-byte) blocks and the 32 x 32 tiles.
SHAPES = [(1, 1), (1, 9), (9, 1), (8, 8), (13, 21), (32, 32), (33, 70), (100, 37), (260, 515)]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64])
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_every_element_lands_transposed(dtype, rows, cols):
    src = (torch.randn(rows, cols) * 50).to(dtype)
    out = torch.zeros(cols, rows, dtype=dtype)
    assert transpose(src, out)
    assert torch.equal(out.reshape(-1).view(torch.uint8), src.t().reshape(-1).view(torch.uint8))  # NaN-safe


def test_rows_of_any_stride_in_and_out_and_nothing_written_outside():
    # out is a window of a larger zero matrix; src a column slice of a wider one, as the loader's
    # tensor-parallel slices of gate_up_proj are.
    wide = torch.randn(70, 100).to(torch.bfloat16)
    src = wide[:, 10:43]  # [70, 33], row stride 100
    frame = torch.zeros(40, 80, dtype=torch.bfloat16)
    out = frame[3:36, 5:75]  # [33, 70], row stride 80
    assert transpose(src, out)
    assert torch.equal(out, src.t())
    outside = frame.clone()
    outside[3:36, 5:75] = 0
    assert not outside.any()


def test_rows_split_over_threads_meet_without_a_gap(monkeypatch):
    monkeypatch.setattr(transpose_module, "PARALLEL_MIN_NUMEL", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    src = torch.randn(1000, 77)  # 32 tiles of rows over 3 threads: 10, 11, 11 tiles, the last one short
    out = torch.full((77, 1000), float("nan"))
    assert transpose(src, out)
    assert torch.equal(out, src.t())


@pytest.mark.parametrize("case", ["shape", "dtype", "src stride", "out stride", "3D"])
def test_what_it_cannot_copy_it_leaves_untouched_and_says_so(case):
    src, out = torch.randn(6, 4), torch.zeros(4, 6)
    if case == "shape":
        out = torch.zeros(6, 4)
    elif case == "dtype":
        out = torch.zeros(4, 6, dtype=torch.float64)
    elif case == "src stride":
        src = torch.randn(4, 6).t()
    elif case == "out stride":
        out = torch.zeros(6, 4).t()
    else:
        src, out = torch.randn(2, 6, 4), torch.zeros(2, 4, 6)
    assert not transpose(src, out)
    assert not out.any()


def test_built_once_per_cache_folder_and_loaded_from_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    transpose_module.library.cache_clear()
    try:
        assert transpose_module.library() is not None
        built = list((tmp_path / "warpspec").glob("transpose-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        transpose_module.library.cache_clear()  # a new process: loads what is there
        assert transpose_module.library() is not None
        assert built[0].stat().st_mtime_ns == mtime
    finally:
        transpose_module.library.cache_clear()


def test_without_a_compiler_it_declines_and_the_loader_copies_with_torch(monkeypatch, caplog):
    from warpspec.workers.layers import copy_transposed

    monkeypatch.setattr(transpose_module, "find_compiler", lambda: None)
    transpose_module.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=transpose_module.__name__):
            src = torch.randn(300, 70).to(torch.bfloat16)
            assert not transpose(src, torch.empty(70, 300, dtype=torch.bfloat16))
        assert "no C compiler" in caplog.text
        dst = torch.empty(70, 300, dtype=torch.bfloat16).t()  # stored transposed, as CPU experts are
        copy_transposed(dst, src)
        assert torch.equal(dst, src)
    finally:
        transpose_module.library.cache_clear()
