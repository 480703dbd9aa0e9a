"""vLLM as bench compare's peer: what the bundled pair needs before vLLM loads it, and the refusals.
The peer itself runs only where its venv is (make vllm-peer); its figures are in benchmarks/results."""

import json
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file

from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET
from warpspec.benchmarks import compare
from warpspec.benchmarks.vllm_peer import VLLMPeer, fold_repeated_aux_layers, hf_overrides, vllm_draft


def test_a_folded_fc_gives_the_same_features_from_the_distinct_layers():
    hidden = 4
    fc = torch.randn(hidden, 3 * hidden, dtype=torch.float64)
    h2, h3 = torch.randn(hidden, dtype=torch.float64), torch.randn(hidden, dtype=torch.float64)
    ids, folded = fold_repeated_aux_layers([2, 3, 3], fc)
    assert ids == [2, 3] and folded.shape == (hidden, 2 * hidden)
    torch.testing.assert_close(folded @ torch.cat([h2, h3]), fc @ torch.cat([h2, h3, h3]))


def test_the_bundled_draft_is_copied_with_distinct_ids_and_the_rest_unchanged(tmp_path):
    out = vllm_draft(BUNDLED_DRAFT, tmp_path / "draft")
    assert out == tmp_path / "draft"
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3]
    before, after = load_file(BUNDLED_DRAFT / "model.safetensors"), load_file(out / "model.safetensors")
    assert after["fc.weight"].shape == (256, 512)
    assert all(torch.equal(before[name], after[name]) for name in before if name != "fc.weight")
    # Distinct ids already: vLLM reads the draft as it is.
    assert vllm_draft(out, tmp_path / "again") == out and not (tmp_path / "again").exists()


def test_moe_layers_become_vllms_interleave_step_or_are_refused(tmp_path):
    # The bundled target: MoE at layers 1, 3, 5 of 6, every second layer from layer 1.
    assert hf_overrides(BUNDLED_TARGET) == {"interleave_moe_layer_step": 2}
    (tmp_path / "config.json").write_text(json.dumps({"moe_layers": [0, 3], "num_hidden_layers": 4}))
    with pytest.raises(SystemExit, match=r"moe_layers \[0, 3\] .* are not so placed"):
        hf_overrides(tmp_path)


def test_a_python_without_vllm_is_refused_before_any_engine_starts():
    with pytest.raises(SystemExit, match="--vllm: .* is not a Python with vLLM installed"):
        compare.main(["--vllm", sys.executable])


def test_the_peer_table_sets_each_engine_of_one_rank_against_its_vllm_counterpart():
    def row(system, workers, rate):
        return {"system": system, "workers": workers, "tokens_per_s_per_user": {"1": rate}}

    rows = [row(compare.VLLM, 0, 100.0), row(compare.VLLM_EAGLE3, 0, 200.0), row("warpspec", "1", 150.0),
            row("warpspec + EAGLE-3 (k=3)", "1", 300.0), row("warpspec", "2", 90.0)]
    lines = compare.peer_table(rows, [1]).strip().splitlines()
    assert lines[2:] == ["| warpspec (1) | 1.50x |", "| warpspec + EAGLE-3 (k=3) (1) | 1.50x |"]
    assert compare.peer_table(rows[2:], [1]) == ""


# A process tree that does what vLLM's engines do after a generation: a child spins (here until it has
# used 0.6 s of CPU), then sleeps.
SPIN = "import time\\nwhile time.process_time() < 0.6: pass\\ntime.sleep(600)"
SPIN_THEN_SLEEP = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "{SPIN}"])
sys.stdin.read()
child.kill()
"""


def test_the_peer_is_left_to_go_quiet_after_a_run():
    peer = object.__new__(VLLMPeer)  # its process only: no vLLM here
    peer.process = subprocess.Popen([sys.executable, "-c", SPIN_THEN_SLEEP], stdin=subprocess.PIPE, text=True)
    try:
        waited = peer.wait_until_quiet()
        (child,) = psutil.Process(peer.process.pid).children()
        assert child.cpu_times().user + child.cpu_times().system >= 0.6 - 0.05 and waited < 10
        before = peer.cpu_seconds()
        assert peer.wait_until_quiet() < 0.5 and peer.cpu_seconds() - before < 0.1  # quiet already
    finally:
        peer.process.stdin.close()
        peer.process.wait(timeout=30)
