"""The structured-output benchmark runs its three sections and writes its tables (figures are not
asserted); llguidance, the library warpspec uses, refuses or enforces every keyword it is shown."""

from __future__ import annotations

import json

import pytest

from warpspec.benchmarks import structured_output


@pytest.mark.slow
def test_bench_structured_output_prints_its_tables(tmp_path, capsys):
    assert structured_output.main(["--mask-batches", "1,4", "--serving-batches", "2", "--new-tokens", "8",
                                   "--repeats", "1", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| library | 30-field schema" in out and "| JSON schema |" in out
    results = json.loads((tmp_path / "bench" / "structured_output.json").read_text())
    llguidance = next(r for r in results["libraries"] if r["library"] == "llguidance")
    assert "IGNORED" not in llguidance["keywords"].values(), llguidance["keywords"]
    assert [(r["batch"], r["drafts"]) for r in results["mask"]] == [(1, 0), (1, 3), (4, 0), (4, 3)]
    assert {(r["draft"], r["kind"]) for r in results["serving"]} == {
        (d, k) for d in (False, True) for k in ("free text", "JSON schema")}
