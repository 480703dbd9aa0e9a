"""vLLM's CPU build as a peer in `warpspec bench compare` (`--vllm PYTHON`): the engine users would pick
instead, plain and with the same EAGLE-3 draft, on the same prompts and token counts.

vLLM lives in a venv of its own (`make vllm-peer`: 3.5 GiB, never the project's). The benchmark starts
benchmarks/vllm_peer_process.py under that venv's Python and keeps it for the whole run, so that vLLM's
generations interleave with the others' as transformers' do; each reply carries the time of vLLM's
`generate` alone. Two things the bundled pair needs before vLLM can load it (DESIGN.md):
- vLLM's Llama 4 places MoE layers by `interleave_moe_layer_step`, not `moe_layers`: the step is
  derived from `moe_layers` and passed as an override;
- vLLM deduplicates the draft's aux layer ids, so a draft reading one layer twice (the bundled one
  reads [2, 3, 3]) gets a copy whose `fc` sums the repeated layer's blocks (below): the same function.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file, save_file

PROCESS = Path(__file__).with_name("vllm_peer_process.py")
START_TIMEOUT_S = 900  # two engines, each compiling its model at start (40-100 s each measured here)
# After a generation, each vLLM engine's worker process polls its shared-memory queue at full speed for
# a second before it sleeps (vllm.distributed.device_communicators.shm_broadcast.SpinCondition,
# busy_loop_s=1): one of the 2 cores, in 0.1 s windows 90-110% for 1.0 s, then 0-10%. A generation
# timed in that second, warpspec's batch 64, took 1.74-1.83 s against 1.41-1.47 s after it. So after
# each of its runs the peer is left to go quiet, outside every timing.
QUIET_WINDOW_S = 0.1
QUIET_SHARE = 0.2  # of one core, over two windows in a row
MAX_QUIET_WAIT_S = 10.0


def fold_repeated_aux_layers(layer_ids: list[int], fc: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The draft's fc over the distinct aux layers, in first-seen order. fc reads the aux hidden states
    concatenated, one block of columns per id; a repeated id's blocks are summed:
    ids [2, 3, 3], fc [W0 | W1 | W2] -> ids [2, 3], fc [W0 | W1 + W2], since
    fc(cat(h2, h3, h3)) == W0 h2 + (W1 + W2) h3."""
    # fc: [hidden, len(layer_ids) * hidden]
    blocks = fc.chunk(len(layer_ids), dim=1)
    distinct = list(dict.fromkeys(layer_ids))
    folded = [sum(block for i, block in zip(layer_ids, blocks, strict=True) if i == layer) for layer in distinct]
    return distinct, torch.cat(folded, dim=1).contiguous()


def vllm_draft(draft: Path, out: Path) -> Path:
    """The draft as vLLM can load it: draft itself when its aux ids are distinct, else a copy under out
    with the ids deduplicated and fc folded."""
    config = json.loads((draft / "config.json").read_text())
    eagle = config.get("eagle_config", {})
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids or len(set(layer_ids)) == len(layer_ids):
        return draft
    weights = load_file(draft / "model.safetensors")
    eagle["eagle_aux_hidden_state_layer_ids"], weights["fc.weight"] = fold_repeated_aux_layers(
        layer_ids, weights["fc.weight"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, out / "model.safetensors")
    return out


def hf_overrides(target: Path) -> dict:
    """{"interleave_moe_layer_step": s} for a target whose MoE layers are every s-th, from layer s-1
    ([1, 3, 5] of 6: s = 2), as vLLM's Llama 4 lays them out; {} when the config states the step."""
    config = json.loads((target / "config.json").read_text())
    moe_layers = config.get("moe_layers")
    if moe_layers is None or "interleave_moe_layer_step" in config:
        return {}
    step = moe_layers[0] + 1
    if moe_layers != list(range(step - 1, config["num_hidden_layers"], step)):
        raise SystemExit(f"--vllm: vLLM's Llama 4 places MoE layers every interleave_moe_layer_step layers; "
                         f"moe_layers {moe_layers} of {target} are not so placed")
    return {"interleave_moe_layer_step": step}


class TimedTokens(list):
    """A generation's tokens, carrying the time the peer measured for it (wall_s)."""

    wall_s: float


class VLLMPeer:
    """vLLM's two engines in their own process (benchmarks/vllm_peer_process.py)."""

    def __init__(self, python: str, target: Path, draft: Path, dtype: str, work_dir: Path,
                 num_speculative_tokens: int = 3, max_model_len: int = 1024):
        python = os.path.abspath(python)  # it starts in a folder of its own; a venv's python is a link to keep
        work_dir.mkdir(parents=True, exist_ok=True)
        args = {"target": str(target.resolve()), "draft": str(vllm_draft(draft, work_dir / "draft").resolve()),
                "dtype": dtype, "max_model_len": max_model_len, "hf_overrides": hf_overrides(target),
                "num_speculative_tokens": num_speculative_tokens}
        self.log_path = work_dir / "vllm.log"
        self.cwd = Path(tempfile.mkdtemp(prefix="vllm-peer-"))  # outside the repository: see the process file
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        # vLLM's CPU install guide preloads Intel's OpenMP (its wheel brings it) for best performance.
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        self.process = subprocess.Popen(
            [python, "-I", str(PROCESS), json.dumps(args)], cwd=self.cwd, text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log_path.open("w"), env={**_environ(), **env})
        ready = self._reply()
        self.version, self.start_s = ready["vllm"], ready["start_s"]

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise SystemExit(f"--vllm: the vLLM process ended (exit {self.process.returncode}); its log: "
                             f"{self.log_path}")
        return json.loads(line)

    def request(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def runner(self, engine: str, new_tokens: int) -> Callable[[list[list[int]]], TimedTokens]:
        def run(prompts: list[list[int]]) -> TimedTokens:
            reply = self.request(cmd="run", engine=engine, prompts=prompts, new_tokens=new_tokens)
            tokens = TimedTokens(reply["tokens"])
            tokens.wall_s = reply["wall_s"]
            self.wait_until_quiet()
            return tokens

        return run

    def cpu_seconds(self) -> float:
        """CPU time so far of the peer's process and every process under it (its engines' own)."""
        total = 0.0
        root = psutil.Process(self.process.pid)
        for process in (root, *root.children(recursive=True)):
            try:
                times = process.cpu_times()
            except psutil.Error:  # ended meanwhile
                continue
            total += times.user + times.system
        return total

    def wait_until_quiet(self) -> float:
        """Wait until the peer's processes use under QUIET_SHARE of a core for two windows in a row (at
        most MAX_QUIET_WAIT_S); returns the seconds waited. See QUIET_WINDOW_S's comment."""
        started = time.monotonic()
        quiet_windows, before = 0, self.cpu_seconds()
        while quiet_windows < 2 and time.monotonic() - started < MAX_QUIET_WAIT_S:
            time.sleep(QUIET_WINDOW_S)
            now = self.cpu_seconds()
            quiet_windows = quiet_windows + 1 if now - before < QUIET_SHARE * QUIET_WINDOW_S else 0
            before = now
        return time.monotonic() - started

    def acceptance_length(self, before: dict, after: dict) -> float | None:
        """Accepted drafts per verification plus the bonus token, between two spec_counts replies."""
        drafts = after["drafts"] - before["drafts"]
        return 1 + (after["accepted"] - before["accepted"]) / drafts if drafts else None

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.cwd, ignore_errors=True)


def _environ() -> dict:
    # The child's own venv: drop this venv's markers so that its Python finds its own packages only.
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}


def check_python(python: str) -> None:
    """Refuse a --vllm that is not a Python with vLLM, before any engine starts."""
    probe = "import importlib.util as u; print(u.find_spec('vllm') is not None)"
    try:
        found = subprocess.run([os.path.abspath(python), "-I", "-c", probe], capture_output=True, text=True,
                               cwd=tempfile.gettempdir()).stdout.strip() == "True"
    except OSError:  # no such file, not executable
        found = False
    if not found:
        raise SystemExit(f"--vllm: {python} is not a Python with vLLM installed (make vllm-peer builds one: "
                         f"runs/vllm-venv/bin/python)")
