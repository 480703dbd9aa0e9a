"""Where a benchmark leaves its figures: runs/bench/NAME.json (the numbers) and NAME.md (the table)."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(run_dir: str | Path, name: str, results: object, table: str) -> Path:
    out = Path(run_dir, "bench")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
    print(f"\nwrote {out / name}.json and {name}.md")
    return out
