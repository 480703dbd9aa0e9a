"""Where compiled steps' artifacts live, and how they travel to a process that has not built them.

Inductor keeps what it builds (generated C++, the built libraries, its FX-graph and AOTAutograd cache
entries) in one folder, TORCHINDUCTOR_CACHE_DIR. A process whose folder already holds a graph's
entries loads that graph instead of compiling it: on 2 cores, 2.7 s against 15.4 s for a small
cpp_wrapper graph, and that held for a copy of the folder made at another path. So the folder is
the artifact:
- `open_compile_cache` picks it: the folder the engine's `compile_cache` option names (a volume every
  replica mounts), else one the environment names, else `<run_dir>/inductor`. One that cannot be
  written is warned about and replaced by a private temporary folder: the engine runs, uncached.
- `pack` bundles what a process added to the folder while it warmed up, with a manifest: what built
  it (torch version, machine, the caller's fingerprint of model and options) and a SHA-256 per file.
- `unpack` checks the manifest before writing anything: a bundle built by another torch, for another
  model, or with a file that does not match its digest is refused with the reason, and the caller
  compiles as if there were none. Files are written whole (a temporary name, then a rename), so a
  process reading the folder meanwhile never sees half a file.

torch.compiler.save_cache_artifacts / load_cache_artifacts ("mega-cache") was the first choice and
does not serve a CPU: it carries the FX-graph and AOTAutograd entries but not the C++ libraries they
point to, and loading it left the same graph at 14.1 s against 14.8 s cold (torch 2.13, 2 cores).

The Ray side (cluster/executor/compile_cache_store.py) keeps bundles in the cluster, for nodes whose
folders are their own. Nothing here imports Ray.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import shutil
import tarfile
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from warpspec.workers.compile.torch_internals import inductor_default_cache_dir

logger = logging.getLogger(__name__)

MANIFEST = "warpspec-manifest.json"
MIN_FREE_BYTES = 256 << 20  # below this much free space the folder counts as full
MAX_BUNDLE_BYTES = 1 << 30  # a process's new artifacts beyond this are not shared (they stay on disk)


def open_compile_cache(folder: str | Path | None, run_dir: str | Path) -> Path:
    """Point inductor at the compile cache folder and return it: `folder` when given, else one the
    environment names (TORCHINDUCTOR_CACHE_DIR; inductor's own default, which it writes there once
    anything compiled, does not count), else run_dir/inductor. A folder that cannot be written, or
    whose disk is full, is warned about and replaced by a private temporary one."""
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder is None and named is not None and Path(named).resolve() != Path(inductor_default_cache_dir()).resolve():
        folder = named
    path = Path(folder if folder is not None else Path(run_dir, "inductor")).resolve()
    problem = _unusable(path)
    if problem is not None:
        fallback = Path(tempfile.mkdtemp(prefix="warpspec-inductor-"))
        warnings.warn(f"compile_cache {str(path)!r} {problem}: compiling into {fallback} instead, which no "
                      "other process reuses", stacklevel=2)
        path = fallback
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def _unusable(path: Path) -> str | None:
    """Why inductor could not keep its artifacts in path, or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as error:
        return f"is not writable ({error.strerror or error})"
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_BYTES:
        return f"is on a full disk ({free >> 20} MiB free, at least {MIN_FREE_BYTES >> 20} MiB needed)"
    return None


def build_fingerprint(**parts: object) -> dict[str, str]:
    """What a bundle must match to be loaded: this torch and machine, and the caller's parts (the
    model's config, the options that shape its graphs), hashed."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return {"torch": torch.__version__, "machine": platform.machine(), "config": digest}


def list_files(folder: Path) -> set[str]:
    """Every file under folder, relative to it (the lock folder's and temporary files excepted)."""
    out = set()
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if path.is_file() and relative.parts[0] != "locks" and not path.name.startswith((".", "tmp")):
            out.add(relative.as_posix())
    return out


@dataclass
class Bundle:
    data: bytes  # an uncompressed tar: the manifest first, then the files
    num_files: int


def pack(folder: Path, files: set[str], fingerprint: dict[str, str]) -> Bundle | None:
    """The given files of folder as a bundle, or None when there are none or they are too large to
    share (MAX_BUNDLE_BYTES)."""
    files = sorted(f for f in files if (folder / f).is_file())
    if not files or sum((folder / f).stat().st_size for f in files) > MAX_BUNDLE_BYTES:
        return None
    contents = {f: (folder / f).read_bytes() for f in files}
    manifest = {"fingerprint": fingerprint,
                "files": {f: hashlib.sha256(data).hexdigest() for f, data in contents.items()}}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in [(MANIFEST, json.dumps(manifest).encode()), *contents.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return Bundle(buffer.getvalue(), len(files))


def unpack(folder: Path, data: bytes, fingerprint: dict[str, str]) -> str | None:
    """Write a bundle's files into folder; None when it did, else why it did not (the folder is then
    as it was). A file folder already has is left alone: inductor names files by their content."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            if MANIFEST not in members:
                return "it has no manifest"
            manifest = json.loads(tar.extractfile(members[MANIFEST]).read())
            contents = {name: tar.extractfile(members[name]).read() for name in manifest["files"]}
    except (tarfile.TarError, KeyError, ValueError, OSError) as error:
        return f"it is not a readable bundle ({type(error).__name__}: {error})"
    reason = _mismatch(manifest["fingerprint"], fingerprint)
    if reason is not None:
        return reason
    for name, data in contents.items():
        if hashlib.sha256(data).hexdigest() != manifest["files"][name]:
            return f"{name} does not match its SHA-256 (corrupt)"
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{name} points outside the cache folder"
    try:
        for name, data in contents.items():
            _write_whole(folder / name, data)
    except OSError as error:
        return f"writing it failed ({error.strerror or error})"
    return None


def _mismatch(theirs: dict[str, str], ours: dict[str, str]) -> str | None:
    if theirs.get("torch") != ours["torch"]:
        return f"it was built by torch {theirs.get('torch')}, this is torch {ours['torch']}"
    if theirs.get("machine") != ours["machine"]:
        return f"it was built on {theirs.get('machine')}, this is {ours['machine']}"
    if theirs.get("config") != ours["config"]:
        return "it was built for another model or other options"
    return None


def _write_whole(path: Path, data: bytes) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".unpack-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(temp, 0o755 if path.suffix == ".so" else 0o644)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
