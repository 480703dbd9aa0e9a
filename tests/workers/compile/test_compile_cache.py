"""The compile cache folder and its bundles (workers/compile/compile_cache.py): where inductor keeps its
artifacts, a folder that cannot be used, and bundles that carry a process's artifacts to an empty
folder, refused when they are corrupt or were built for something else."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch

from warpspec.workers.compile.compile_cache import (
    MANIFEST,
    build_fingerprint,
    list_files,
    open_compile_cache,
    pack,
    unpack,
)
from warpspec.workers.compile.torch_internals import (
    compile_with_inductor,
    fx_graph_cache_counts,
    inductor_default_cache_dir,
)
from warpspec.workers.compile.vec_isa import vec_isa_options


@pytest.fixture(autouse=True)
def the_sessions_folder_afterwards(monkeypatch):
    """These tests point inductor at folders of their own (open_compile_cache sets the variable);
    the tests after them compile into the session's folder again (tests/conftest.py)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ["TORCHINDUCTOR_CACHE_DIR"])


def scale_and_shift(x):
    return x * 3 - 1


def compile_once(folder) -> torch.Tensor:
    """scale_and_shift compiled into folder, on a code object of its own (dynamo's in-memory graphs
    of another copy do not count), with the instruction-set switch warpspec's steps compile under:
    without it each new folder paid inductor's probe again (about 10 s of the 15 a compile took)."""
    open_compile_cache(folder, "unused")
    fn = type(scale_and_shift)(scale_and_shift.__code__.replace(), globals(), "scale_and_shift")
    options = vec_isa_options()
    compiled = torch.compile(fn, backend=lambda g, inputs: compile_with_inductor(g, inputs, options), dynamic=False)
    return compiled(torch.arange(6.0))


def test_the_folder_is_the_option_then_the_environment_then_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert open_compile_cache(None, tmp_path / "a") == (tmp_path / "a" / "inductor").resolve()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "a" / "inductor").resolve())
    # Inductor's own default, written once anything compiled, is not a choice: the run folder wins.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_default_cache_dir())
    assert open_compile_cache(None, tmp_path / "b") == (tmp_path / "b" / "inductor").resolve()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert open_compile_cache(None, tmp_path / "c") == (tmp_path / "mine").resolve()
    # The engine's compile_cache option wins over both.
    assert open_compile_cache(str(tmp_path / "shared"), tmp_path / "c") == (tmp_path / "shared").resolve()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "shared").resolve())


def test_a_folder_that_cannot_be_written_is_named_and_replaced_by_a_private_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the private folder is made, and removed, here
    (tmp_path / "a-file").write_text("")
    blocked = tmp_path / "a-file" / "cache"  # under a regular file: no one can create it, root included
    with pytest.warns(UserWarning, match=r"compile_cache '.*a-file/cache' is not writable"):
        folder = open_compile_cache(str(blocked), tmp_path)
    assert folder != blocked and folder.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert torch.equal(compile_once(folder), scale_and_shift(torch.arange(6.0)))  # it still compiles


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(a folder where a fresh process compiled scale_and_shift, the bundle of what that added). A
    process of its own: this one keeps built libraries in memory and would not write them again."""
    folder = tmp_path_factory.mktemp("built")
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parent)}
    subprocess.run([sys.executable, "-c", f"import test_compile_cache as t; t.compile_once({str(folder)!r})"],
                   check=True, env=env, timeout=300)
    bundle = pack(folder, list_files(folder), build_fingerprint(model="m"))
    assert bundle is not None and any(name.endswith(".so") for name in list_files(folder))
    return folder, bundle


def test_a_bundle_makes_an_empty_folder_load_the_graph_instead_of_compiling_it(built, tmp_path, monkeypatch):
    _, bundle = built
    assert unpack(tmp_path, bundle.data, build_fingerprint(model="m")) is None
    hits, misses = fx_graph_cache_counts()
    assert torch.equal(compile_once(tmp_path), scale_and_shift(torch.arange(6.0)))
    assert fx_graph_cache_counts() == (hits + 1, misses)


def rewrite(bundle: bytes, change) -> bytes:
    """The bundle with change(name, data) -> data applied to every member."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tar, tarfile.open(fileobj=out, mode="w") as new:
        for member in tar.getmembers():
            data = change(member.name, tar.extractfile(member).read())
            member.size = len(data)
            new.addfile(member, io.BytesIO(data))
    return out.getvalue()


def test_a_corrupt_file_refuses_the_whole_bundle_and_writes_nothing(built, tmp_path):
    _, bundle = built
    flipped = {}

    def corrupt_first_library(name, data):
        if name.endswith(".so") and not flipped:
            flipped[name] = True
            return data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
        return data

    reason = unpack(tmp_path, rewrite(bundle.data, corrupt_first_library), build_fingerprint(model="m"))
    (name,) = flipped
    assert reason == f"{name} does not match its SHA-256 (corrupt)"
    assert list_files(tmp_path) == set()
    assert unpack(tmp_path, bundle.data[: len(bundle.data) // 3], build_fingerprint(model="m")).startswith(
        "it is not a readable bundle")


def test_a_bundle_built_for_another_model_or_by_another_torch_is_refused_with_the_reason(built, tmp_path):
    _, bundle = built
    assert unpack(tmp_path, bundle.data, build_fingerprint(model="other")) == \
        "it was built for another model or other options"

    def older_torch(name, data):
        return data.replace(torch.__version__.encode(), b"2.12.0") if name == MANIFEST else data

    assert unpack(tmp_path, rewrite(bundle.data, older_torch), build_fingerprint(model="m")) == \
        f"it was built by torch 2.12.0, this is torch {torch.__version__}"
    assert list_files(tmp_path) == set()
