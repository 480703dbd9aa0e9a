"""Regenerate the Python stubs of protos/warpspec/v1/*.proto (grpcio-tools, a test dependency).

    python -m warpspec.protos.generate          # rewrites the committed stubs in place

The stubs are committed so that serving needs no code generation at install time; the test
tests/serving/test_generated_protos.py regenerates them into a temporary folder and fails if they differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # protos/: proto import paths are relative to it
PROTO_FILES = ["warpspec/v1/generation.proto"]
# protoc names modules by the proto's path as seen from PROTO_ROOT (`from warpspec.v1 import
# generation_pb2`, and messages' __module__ 'warpspec.v1.generation_pb2', which pickling - Ray Serve's
# proxy pickles every request - must be able to import). Installed, protos/ is the package
# warpspec.protos, so both must say warpspec.protos.warpspec.v1.
_FIXES = [(re.compile(r"^from warpspec\.v1 import ", re.MULTILINE), "from warpspec.protos.warpspec.v1 import "),
          (re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'warpspec\.v1\."),
           r"\1'warpspec.protos.warpspec.v1.")]


def generate(out_dir: str | Path) -> list[Path]:
    """Write <name>_pb2.py, <name>_pb2.pyi and <name>_pb2_grpc.py for every proto under out_dir,
    mirroring the proto paths; returns the written files."""
    from grpc_tools import protoc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # well-known types
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILES}")
    written = []
    for proto in PROTO_FILES:
        stem = out / proto[: -len(".proto")]
        for path in (Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")):
            text = path.read_text()
            for pattern, replacement in _FIXES:
                text = pattern.sub(replacement, text)
            path.write_text(text)
            written.append(path)
    return written


if __name__ == "__main__":
    for path in generate(PROTO_ROOT):
        print(path)
    sys.exit(0)
