"""`warpspec bench trees`: tree acceptance computed from the draft's outputs, checked where the engine
runs the same thing (the chain), and the shapes it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.eagle3_checkpoints import make_speculation_draft, make_speculation_target
from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET, held_out_prompts
from warpspec.benchmarks import trees
from warpspec.benchmarks.trees import DraftTrees, Node, TreeShape


def test_shapes_parse_and_the_impossible_are_refused():
    assert TreeShape.parse("4x5x12") == TreeShape(4, 5, 12)
    assert TreeShape.parse("chain3") == TreeShape(1, 3, 3)
    assert TreeShape(2, 3, 5).max_nodes == 2 + 2 * 4
    with pytest.raises(ValueError, match=r"--trees: '4x5' is not TOPKxDEPTHxNODES"):
        TreeShape.parse("4x5")
    with pytest.raises(ValueError, match="at least 1"):
        TreeShape.parse("0x3x3")
    with pytest.raises(ValueError, match="11 nodes, but a tree of top_k 2 and depth 3 drafts at most 10"):
        TreeShape.parse("2x3x11")


def test_greedy_verification_accepts_the_longest_path_the_continuation_follows():
    # root -> 5 -> 7 -> 9
    #      -> 6 -> 8
    five = Node(5, 1, -0.1, None)
    six = Node(6, 1, -0.5, None)
    seven, eight = Node(7, 2, -0.3, five), Node(8, 2, -0.9, six)
    tree = [five, six, seven, eight, Node(9, 3, -0.4, seven)]
    assert DraftTrees.accepted(tree, [5, 7, 9, 1]) == 3
    assert DraftTrees.accepted(tree, [6, 8, 9]) == 2  # 9 hangs below 7, not below 8
    assert DraftTrees.accepted(tree, [6, 7]) == 1
    assert DraftTrees.accepted(tree, [4, 5]) == 0


@pytest.mark.slow
def test_the_chain_computed_from_the_draft_takes_the_engines_own_steps(tmp_path, capsys):
    """On the bundled pair (acceptance ~3.3): the chain k=3 walked here accepts exactly what the
    engine's chain accepted, step by step in total; every tree stays within its depth."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompt_token_ids": held_out_prompts()[:3]}))
    assert trees.main(["--target", str(BUNDLED_TARGET), "--draft", str(BUNDLED_DRAFT), "--prompts", str(prompts),
                       "--num-prompts", "3", "--new-tokens", "24", "--trees", "chain5,2x4x6,4x5x12", "--skip-costs",
                       "--run-dir", str(tmp_path)]) == 0
    assert "the same steps as the chain computed here" in capsys.readouterr().out
    report = json.loads((tmp_path / "bench" / "trees.json").read_text())
    chain, *others = report["rows"]
    assert (chain["accepted"], chain["steps"]) == (report["engine_chain"]["accepted"], report["engine_chain"]["steps"])
    assert chain["acceptance_length"] > 2.5  # a trained draft: the check is not of a chain that accepts nothing
    for row in others:
        assert 1 <= row["acceptance_length"] <= row["depth"] + 1
    assert (tmp_path / "bench" / "trees.png").stat().st_size > 0


@pytest.mark.slow
def test_the_cost_columns_come_from_each_verification_lengths_engine(tmp_path, capsys):
    target, draft = make_speculation_target(tmp_path / "target"), make_speculation_draft(tmp_path / "draft")
    prompts = tmp_path / "prompts.json"
    prompt = torch.randint(3, 160, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts.write_text(json.dumps({"prompt_token_ids": [prompt]}))
    assert trees.main(["--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--new-tokens", "12",
                       "--num-speculative-tokens", "2", "--trees", "2x2x4", "--run-dir", str(tmp_path)]) == 0
    assert "| tree 2x2, 4 nodes | 5 |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "bench" / "trees.json").read_text())["rows"]
    assert [r["num_nodes"] for r in rows] == [2, 4]
    for row in rows:
        assert row["verify_ms"] > 0 and row["draft_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["step_ms"] == pytest.approx(row["verify_ms"] + row["draft_ms"] + row["host_ms"])
    assert (tmp_path / "bench" / "trees.png").stat().st_size > 0


def test_bad_arguments_name_the_flag(capsys, tmp_path):
    with pytest.raises(SystemExit):
        trees.main(["--trees", "3x3", "--skip-costs"])
    assert "--trees: '3x3' is not TOPKxDEPTHxNODES" in capsys.readouterr().err
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompt_token_ids": [[1, 2, 99999]]}))
    with pytest.raises(SystemExit, match="--prompts: prompt 0 holds token id 99999, outside the target's vocabulary"):
        trees.main(["--prompts", str(prompts), "--skip-costs"])
