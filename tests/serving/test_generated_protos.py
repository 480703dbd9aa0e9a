"""The committed gRPC stubs are what protoc makes of the committed .proto today, and they import
inside the package (protoc's own import line would be `from warpspec.v1 import ...`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from warpspec.protos.generate import PROTO_ROOT, generate  # noqa: E402

# Lines that only record which protoc / grpcio-tools made the file: another tools release must not
# fail the check as long as the code itself is the same.
_VERSION_LINES = [re.compile(r"^# Protobuf Python Version: .*$", re.MULTILINE),
                  re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.MULTILINE),
                  re.compile(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", re.DOTALL)]


def _normalized(text: str) -> str:
    for pattern in _VERSION_LINES:
        text = pattern.sub("<version>", text)
    return text


def test_committed_stubs_are_current(tmp_path: Path):
    for fresh in generate(tmp_path):
        committed = PROTO_ROOT / fresh.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run python -m warpspec.protos.generate"
        assert _normalized(committed.read_text()) == _normalized(fresh.read_text()), (
            f"{committed} is stale: run python -m warpspec.protos.generate")


def test_stubs_import_inside_the_package():
    from warpspec.protos.warpspec.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2_grpc.warpspec_dot_v1_dot_generation__pb2 is generation_pb2
    request = generation_pb2.GenerateRequest(prompt="hi", params=generation_pb2.SamplingParams(temperature=0.0))
    # proto3 `optional`: an explicit 0 is distinguishable from unset.
    assert request.params.HasField("temperature") and not request.params.HasField("top_p")
    assert request.WhichOneof("prompt_input") == "prompt"


def test_messages_pickle():
    """Serve's gRPC proxy pickles each request to the replica: the messages' module must import."""
    import pickle

    from warpspec.protos.warpspec.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(prompt="hi", request_id="r")
    assert pickle.loads(pickle.dumps(request)) == request
