"""Scripts that start a Ray cluster of their own (a Serve config deployed as `serve deploy` would, a
cluster whose environment asks for traces), run in a process of their own: Serve is one per Ray
cluster, and the serving tests keep theirs running on the shared one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def run_on_private_cluster(script: Path, args: list[str], what: str, timeout_s: int, env: dict | None = None,
                           cwd: Path | None = None) -> dict:
    """Run `python script *args TEMP_DIR` (TEMP_DIR: a short folder for Ray's sockets, removed after)
    and return the JSON object its last line prints; the test fails, naming what, if it fails or
    outlasts timeout_s (then it and the Ray processes it started are killed)."""
    temp_dir = tempfile.mkdtemp(prefix="ws-private-")  # Ray's unix sockets need a short path
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"} | (env or {})
    proc = subprocess.Popen([sys.executable, str(script), *args, temp_dir], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and the Ray processes it started
        out, err = proc.communicate()
        pytest.fail(f"{what} took over {timeout_s} s: {err[-3000:]}")
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert proc.returncode == 0, f"{what} failed: {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])
