"""Run inside an installed warpspec's venv: import every module of the package, and find every
third-party name any of them imports (at top level or inside a function) that the venv lacks.
Prints one JSON object: {"modules": N, "failed": {module: error}, "missing": {name: [modules]}}."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
import sys
from pathlib import Path

import warpspec

modules, failed, importers = [], {}, {}
for info in pkgutil.walk_packages(warpspec.__path__, "warpspec."):
    if info.name.endswith("__main__"):  # runs the command line when imported
        continue
    modules.append(info.name)
    source = Path(importlib.util.find_spec(info.name).origin).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            importers.setdefault(name.split(".")[0], set()).add(info.name)
    try:
        importlib.import_module(info.name)
    except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the scan
        failed[info.name] = f"{type(error).__name__}: {error}"
missing = {name: sorted(mods) for name, mods in importers.items()
           if name not in sys.stdlib_module_names and importlib.util.find_spec(name) is None}
print(json.dumps({"modules": len(modules), "failed": failed, "missing": missing}))
