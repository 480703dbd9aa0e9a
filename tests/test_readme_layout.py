"""The README's layout table names every folder git holds, and nothing else: the top-level folders,
each subpackage of cluster/ with its import name, and workers/'s subpackages."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def layout_rows() -> dict[str, str]:
    """{'cluster/core/': 'warpspec.core', 'k8s/': '', ...} from the README's "## Layout" table."""
    section = REPO.joinpath("README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+/)` \| (?:`([^`]+)`)? *\|", line)
        if match:
            rows[match.group(1)] = match.group(2) or ""
    return rows


def tracked_folders() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    top = {f.split("/")[0] + "/" for f in files if "/" in f and not f.startswith(".")}
    packages = {f.rsplit("/", 1)[0] + "/" for f in files if re.fullmatch(r"(cluster|workers)/[^/]+/__init__\.py", f)}
    return top | packages


def test_the_layout_table_lists_exactly_the_folders_in_git():
    rows = layout_rows()
    assert set(rows) == tracked_folders(), (f"missing from the README: {sorted(tracked_folders() - set(rows))}; "
                                            f"not in git: {sorted(set(rows) - tracked_folders())}")


def test_each_cluster_subpackage_row_gives_its_import_name():
    for folder, name in layout_rows().items():
        if folder.startswith("cluster/") and folder != "cluster/":
            assert name == "warpspec." + folder.removeprefix("cluster/").rstrip("/"), folder
