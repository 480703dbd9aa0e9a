"""The `warpspec` command as a user runs it: a real subprocess through the installed entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from warpspec import LLM, SamplingParams
from warpspec.training.random_checkpoint import create_random_checkpoint

WARPSPEC = shutil.which("warpspec") or str(Path(sys.executable).with_name("warpspec"))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([WARPSPEC, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("cli"), "tiny", std=0.3)


def test_help_lists_the_commands():
    result = run("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout and "create-checkpoint" in result.stdout
    module = subprocess.run([sys.executable, "-m", "warpspec", "--help"], capture_output=True, text=True, timeout=120)
    assert module.returncode == 0 and module.stdout == result.stdout  # python -m warpspec is the same command


def test_generate_json_matches_the_python_api(checkpoint):
    result = run("generate", "--model", str(checkpoint), "--prompt", "def f(x):", "--max-tokens", "12",
                 "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    with LLM(str(checkpoint)) as llm:
        expected = llm.generate("def f(x):", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert got["token_ids"] == expected.token_ids and got["text"] == expected.text
    assert got["finish_reason"] == "length" and got["prompt_token_ids"] == expected.prompt_token_ids


def test_generate_deterministic_bf16_matches_the_python_api(checkpoint):
    result = run("generate", "--model", str(checkpoint), "--prompt", "def f(x):", "--max-tokens", "12",
                 "--ignore-eos", "--json", "--dtype", "bfloat16", "--deterministic")
    assert result.returncode == 0, result.stderr
    with LLM(str(checkpoint), dtype="bfloat16", deterministic=True) as llm:
        expected = llm.generate("def f(x):", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert json.loads(result.stdout)["token_ids"] == expected.token_ids


def test_generate_from_token_ids(checkpoint):
    result = run("generate", "--model", str(checkpoint), "--prompt-token-ids", "1,40,41", "--max-tokens", "3",
                 "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["prompt_token_ids"] == [1, 40, 41]


@pytest.mark.parametrize("args,message", [
    (["--model", "/does/not/exist", "--prompt", "x"], "model folder '/does/not/exist' does not exist"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt-token-ids", "1,x"], "--prompt-token-ids must be comma-separated integers"),
    (["--prompt", "x", "--max-tokens", "0"], "max_tokens must be >= 1"),
])
def test_errors_are_one_line_without_a_traceback(checkpoint, args, message):
    if "--model" not in args:
        args = ["--model", str(checkpoint), *args]
    result = run("generate", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_generate_on_a_transformers_saved_checkpoint(checkpoint, tmp_path):
    from helpers.hf_checkpoints import load_reference, make_text_checkpoint, reference_greedy

    hf_dir = make_text_checkpoint(tmp_path / "hf", vocab_size=512)
    shutil.copy(checkpoint / "tokenizer.json", hf_dir / "tokenizer.json")
    result = run("generate", "--model", str(hf_dir), "--prompt", "import sys", "--max-tokens", "10",
                 "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["token_ids"] == reference_greedy(load_reference(hf_dir), got["prompt_token_ids"], 10)
