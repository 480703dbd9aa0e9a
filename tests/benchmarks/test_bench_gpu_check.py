"""The GPU check script stays ready to run: its tiny mode runs the same code on this CPU (Triton
under the interpreter), and it imports without Ray (the GPU machine may have torch and Triton only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_tiny_gpu_check_reports_every_part(tmp_path):
    from warpspec.benchmarks.gpu_check import main

    status = main(["--tiny", "--out", str(tmp_path), "--repeats", "1", "--profile"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 0 and report["errors"] == []
    names = [k["name"] for k in report["kernels"]]
    for kernel in ("add_rms_norm", "rope + qk_norm", "route_topk_sigmoid", "quantize_fp8", "paged_attention decode",
                   "paged_attention verify", "moe_experts 1 token fp8", "moe_experts 8 tokens bf16",
                   "moe_experts 1 token fp8, TP rank", "moe_experts 8 tokens fp8, TP rank",
                   "batch_invariant_linear [32 x hidden]", "batch_invariant_linear: 32 rows = each row alone"):
        assert any(n.startswith(kernel) for n in names), kernel
    assert all(k["passed"] and not k["error"] for k in report["kernels"])
    assert {b["kernel"] for b in report["bandwidth"]} == {
        n for n in names if n.startswith(("paged", "moe", "batch_invariant_linear ["))}
    shapes = {(r["moe_parallel"], r["batch"], r["query_len"]) for r in report["simulation"]}
    assert shapes == {(layout, b, q) for layout in ("tensor", "expert") for b in (1, 8) for q in (1, 4)}
    for row in report["simulation"]:
        assert row["eager_ms"] > 0 and row["total_gb"] > 0
    by_shape = {(r["moe_parallel"], r["batch"], r["query_len"]): r for r in report["simulation"]}
    for layout in ("tensor", "expert"):
        # 8 sequences x 4 tokens choose more experts than 1 token, so the step reads more.
        assert by_shape[layout, 8, 4]["expected_distinct_experts"] > by_shape[layout, 1, 1]["expected_distinct_experts"]
        assert by_shape[layout, 1, 1]["expected_distinct_experts"] == 1
    # One token reads 1/8 of one expert split by width, a whole expert otherwise, of about the same
    # weights (split by width, each of the 8x more slices keeps its down_proj's per-column scales).
    assert by_shape["tensor", 1, 1]["total_gb"] < by_shape["expert", 1, 1]["total_gb"]
    assert by_shape["tensor", 1, 1]["all_expert_weights_gb"] == pytest.approx(
        by_shape["expert", 1, 1]["all_expert_weights_gb"], rel=0.1)
    projection = report["projection"]["8us"]
    assert {p["tokens_per_step"] for p in projection} == {1.0, report["acceptance_length"]}
    assert {p["moe_parallel"] for p in projection} == {"tensor", "expert"}
    draft = {d["batch"]: d for d in report["draft"]}
    assert set(draft) == {1, 8}
    for d in draft.values():  # a catch-up over k+1 tokens, then k-1 one-token forwards
        assert d["draft_ms"] == pytest.approx(d["catch_up_ms"] + 2 * d["single_token_ms"])
    for p in projection:  # every step pays the host time; only verification pays the draft
        assert p["host_ms"] == report["host_ms"] > 0
        assert p["draft_ms"] == (draft[p["batch"]]["draft_ms"] if p["query_len"] > 1 else 0.0)
    for layout in ("tensor", "expert"):  # one decode step's top ops (CPU time here), largest first
        rows = report["profile"][layout]
        assert 0 < len(rows) <= 15 and all(r["calls"] >= 1 for r in rows)
        assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
        assert 0 < sum(r["fraction"] for r in rows) <= 1 + 1e-9
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| kernel | relative error |" in markdown and "tokens/s per user" in markdown
    assert "Top kernels of one eager decode step at batch 1, tensor layout" in markdown
    assert "| batch | catch-up ms | one-token forward ms | draft ms per step |" in markdown


def test_the_projection_counts_host_and_draft_time():
    from warpspec.benchmarks.maverick_rank import project

    rows = [{"moe_parallel": "tensor", "batch": 1, "query_len": q, "graph_ms": 2.0, "eager_ms": 9.0, "total_gb": 1.0}
            for q in (1, 4)]
    decode, verify = project(rows, copy_gbs=1000.0, num_layers=48, allreduce_us=10.0, acceptance_length=3.0,
                             host_ms=0.5, draft_ms_by_batch={1: 0.54})
    # 2 ms of rank time (the graph's), 2 x 48 all-reduces of 10 us, 0.5 ms of host time
    assert decode["step_ms"] == pytest.approx(2.0 + 0.96 + 0.5)
    assert decode["tok_s_per_user"] == pytest.approx(1e3 / 3.46)
    assert verify["step_ms"] == pytest.approx(2.0 + 0.96 + 0.5 + 0.54)
    assert verify["tok_s_per_user"] == pytest.approx(3.0e3 / 4.0)


def test_gpu_check_imports_without_ray():
    code = ("import sys, warpspec.benchmarks.gpu_check, warpspec.benchmarks.kernel_check, "
            "warpspec.benchmarks.maverick_rank, warpspec.benchmarks.maverick_draft; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_check_without_a_gpu_needs_tiny(tmp_path, capsys):
    import torch

    from warpspec.benchmarks.gpu_check import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert "use --tiny" in capsys.readouterr().err
