"""warpspec installed as a user installs it, into a clean venv without the test extra: every module
imports, and every third-party import in the package is a runtime dependency or belongs to the
extra that says so."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Imports a plain install may lack, and the extra (or the tool) that provides each.
OPTIONAL = {
    "triton": "gpu",  # kernels/triton, loaded only where Triton runs
    "cupy": "gpu",  # the NCCL backend of workers/distributed/comm.py
    "transformers": "bench",  # the reference beside warpspec in bench compare / throughput
    "matplotlib": "bench",
    "xgrammar": "bench",  # compared with llguidance in bench structured_output
    "grpc_tools": "test",  # protos/generate.py regenerates the committed stubs (a maintainer's tool)
}
# Imports no extra provides: the modules that import them run under another Python.
OUTSIDE = {"vllm"}  # benchmarks/vllm_peer_process.py, run by the Python of vLLM's own venv (make vllm-peer)


def _extra_import_names(extra: str) -> set[str]:
    """Import names of an extra's requirements, from warpspec's installed metadata:
    'cupy-cuda12x>=13; extra == "gpu"' -> cupy, 'grpcio-tools>=1.85.1; extra == "test"' -> grpc_tools."""
    names = set()
    for requirement in requires("warpspec") or []:
        if f'extra == "{extra}"' not in requirement:
            continue
        dist = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower()
        names.add({"grpcio-tools": "grpc_tools", "cupy-cuda12x": "cupy"}.get(dist, dist.replace("-", "_")))
    return names


@pytest.mark.slow
def test_a_clean_install_imports_every_module(tmp_path):
    for name, extra in OPTIONAL.items():
        assert name in _extra_import_names(extra), f"{name} should be in the [{extra}] extra"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: no .pyc for every file of torch and Ray up front (the scan compiles what it imports).
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    # The CPU build of torch first, as the Makefile does, so pip does not fetch a CUDA build.
    subprocess.run([*pip, f"torch=={version('torch').split('+')[0]}"], check=True, timeout=600)
    # From a copy: setuptools leaves its build/ scratch in the source folder, and a stale one would
    # put modules deleted since into the wheel.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "dist", "*.egg-info",
                                                                "__pycache__", ".pytest_cache", ".ruff_cache"))
    subprocess.run([*pip, str(source)], check=True, timeout=900)
    scan = subprocess.run([str(venv / "bin" / "python"), str(REPO / "tests" / "helpers" / "import_every_module.py")],
                          capture_output=True, text=True, check=True, cwd=tmp_path, timeout=300)
    report = json.loads(scan.stdout.strip().splitlines()[-1])
    assert report["modules"] > 100
    assert set(report["missing"]) <= set(OPTIONAL) | OUTSIDE, report["missing"]
    # Only modules that need an optional package may fail to import, and only for that reason.
    for module, error in report["failed"].items():
        assert any(f"No module named '{name}'" in error for name in report["missing"]), (module, error)
