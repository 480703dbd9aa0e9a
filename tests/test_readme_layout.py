"""The layout table of the documentation (docs/architecture.md) names every folder git holds, and
nothing else: the top-level folders, each subpackage of cluster/ with its import name, and workers/'s
subpackages. The README stays a front door: short, and every figure in it names its host."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def layout_rows() -> dict[str, str]:
    """{'cluster/core/': 'warpspec.core', 'k8s/': '', ...} from the "## Layout" table of the architecture page."""
    section = REPO.joinpath("docs", "architecture.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
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
    assert set(rows) == tracked_folders(), (f"missing from the table: {sorted(tracked_folders() - set(rows))}; "
                                            f"not in git: {sorted(set(rows) - tracked_folders())}")


def test_each_cluster_subpackage_row_gives_its_import_name():
    for folder, name in layout_rows().items():
        if folder.startswith("cluster/") and folder != "cluster/":
            assert name == "warpspec." + folder.removeprefix("cluster/").rstrip("/"), folder


def test_the_readme_is_a_front_door():
    """At most 250 lines, its links lead to files that exist, and each row of its figures names a host."""
    readme = REPO.joinpath("README.md").read_text()
    assert readme.count("\n") <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and all(REPO.joinpath(link).exists() for link in links if "://" not in link), links
    figures = readme.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in figures.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert rows and all(re.search(r"Intel|AMD EPYC|H100|H200", row.rsplit("|", 2)[1]) for row in rows), rows
