"""The bundled model pair: small enough to ship, loaded the same by transformers and warpspec,
speculation lossless on it with a useful acceptance length, and the one-command demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.hf_checkpoints import load_reference, reference_greedy
from warpspec import LLM, SamplingParams
from warpspec.assets import ASSETS, BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts

REPO = Path(__file__).parents[2]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def test_pair_ships_under_40_mb_with_its_card():
    size = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert size < 40 * 2**20
    assert json.loads((BUNDLED_TARGET / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
    assert json.loads((BUNDLED_DRAFT / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    card = (ASSETS / "MODEL_CARD.md").read_text()
    # The card quotes the perplexity the training run measured, to two decimals.
    report = json.loads((BUNDLED_TARGET / "training_report.json").read_text())
    assert f"{report['val_perplexity']:.2f}" in card
    # ... and the draft's held-out agreement at its last step, per unrolled step, to three decimals.
    draft_report = json.loads((BUNDLED_DRAFT / "training_report.json").read_text())
    last = draft_report["history"][-1]
    assert last["step"] == draft_report["config"]["steps"]
    assert " / ".join(f"{a:.3f}" for a in last["val_agreement"]) in card


def test_target_matches_transformers_greedy():
    prompts = held_out_prompts()[:2]
    reference = load_reference(BUNDLED_TARGET)
    with LLM(str(BUNDLED_TARGET), dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_greedy(reference, prompt, 16)


@pytest.mark.slow
def test_speculation_is_lossless_and_accepts_on_held_out_prompts():
    prompts = held_out_prompts()
    with LLM(str(BUNDLED_TARGET), dtype="float32") as llm:
        expected = llm.generate(prompts, GREEDY)
    # Fixed k = 3, the card's: a step that chose k = 1 would cap its acceptance at 2.0.
    with LLM(str(BUNDLED_TARGET), dtype="float32", draft=str(BUNDLED_DRAFT), compile_draft=False,
             speculative_policy="fixed") as llm:
        got = llm.generate(prompts, GREEDY)
        stats = llm.engine.spec_stats
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    # A regression guard well under what the card reports (k=3: 1.0 means nothing accepted, 4.0 all).
    assert stats.acceptance_length > 2.0


def ray_processes(temp_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with_dir = any(str(temp_dir) in part for part in (proc.info["cmdline"] or []))
        if with_dir and proc.pid != os.getpid():
            found.append(proc)
    return found


@pytest.mark.slow
def test_demo_streams_real_text_and_leaves_no_process():
    run_dir = REPO / "runs" / "test-demo"
    # Without the suite's WARPSPEC_ENFORCE_EAGER: the demo runs its steps eagerly by itself.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "WARPSPEC_ENFORCE_EAGER")}
    result = subprocess.run([sys.executable, "-m", "warpspec.cli.main", "demo", "--requests", "3", "--max-tokens", "24",
                             "--grpc-port", "9301", "--http-port", "8301", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| request | prompt | tokens | TTFT (ms) | tokens/s | acceptance length |" in result.stdout
    assert "3 concurrent requests: 72 tokens" in result.stdout
    assert "[prompt] " in result.stdout and " [model] " in result.stdout  # where the prompt ends
    # Start and stop say nothing alarming: neither Serve reconnecting to itself nor a killed controller.
    output = result.stdout + result.stderr
    # Each start-up phase shows as it ends, forwarded from the replica's processes; nothing compiles.
    assert "start-up: weights and KV cache in" in result.stderr and "start-up: draft in" in result.stderr
    assert "| warm-up request |" in result.stderr and "compile target steps" not in result.stderr
    assert "Connecting to existing Serve app" not in output and "graceful_shutdown failed" not in output
    deadline = time.monotonic() + 20
    while ray_processes((run_dir / "ray").resolve()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes((run_dir / "ray").resolve())
