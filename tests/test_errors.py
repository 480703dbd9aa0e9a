"""Every error a user can meet is defined in warpspec.errors (workers.errors' CheckpointError, which the
workers raise without importing the package above them, is re-exported there). The exceptions defined
elsewhere are internal, each with its reason below."""

import ast
from pathlib import Path

import warpspec
from warpspec import errors

REPO = Path(__file__).resolve().parent.parent
INTERNAL = {
    "OutOfBlocksError": "core/block_manager.py: the scheduler catches it and preempts",
    "GrpcStatusError": "serving/deployment.py: carries a status already set on the gRPC context",
    "CollectiveError": "workers/distributed/comm.py: the coordinator turns it into WorkerDiedError",
    "CheckpointError": "workers/errors.py: re-exported by warpspec.errors",
}


def exception_classes(folder: str) -> dict[str, str]:
    """{class name: file} for every class in folder whose bases name an Error or Exception."""
    found = {}
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith(("Error", "Exception"))
                                                      for b in node.bases):
                found[node.name] = str(path.relative_to(REPO))
    return found


def test_user_facing_exceptions_are_all_defined_in_errors_py():
    defined = {**exception_classes("cluster"), **exception_classes("workers"), **exception_classes("kernels")}
    elsewhere = {name: path for name, path in defined.items() if path != "cluster/errors.py" and name not in INTERNAL}
    assert not elsewhere, f"exceptions outside cluster/errors.py (move them, or say in INTERNAL why not): {elsewhere}"
    assert set(INTERNAL) <= set(defined), f"INTERNAL names classes that no longer exist: {set(INTERNAL) - set(defined)}"


def test_errors_exports_every_class_it_holds_and_the_package_re_exports_the_public_ones():
    held = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, Exception)}
    assert held == set(errors.__all__)
    assert warpspec.InvalidRequestError is errors.InvalidRequestError
    assert warpspec.CheckpointError is errors.CheckpointError
