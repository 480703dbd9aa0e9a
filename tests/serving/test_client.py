"""warpspec.cli.client and `warpspec client` against the running stack."""

from __future__ import annotations

import json

import grpc
import pytest

from warpspec.cli.client import GenerationClient
from warpspec.cli.main import main
from warpspec.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_client_library(serving_stack, reference_llm):
    expected = reference_llm.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.0))[0]
    with GenerationClient(serving_stack.grpc_target, timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.model_info().model == "tiny"
        assert client.generate("Hello", max_tokens=6, temperature=0.0).text == expected.text
        assert "".join(d.text for d in client.stream("Hello", max_tokens=6, temperature=0.0)) == expected.text
        assert list(client.generate(expected.prompt_token_ids, max_tokens=6, temperature=0.0).token_ids) == \
            expected.token_ids
        with pytest.raises(TypeError, match="unknown sampling parameter"):
            client.generate("Hello", max_token=6)
        with pytest.raises(grpc.RpcError) as error:
            client.generate("Hello", max_tokens=-1)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_command(serving_stack, reference_llm, capsys):
    expected = reference_llm.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.0))[0]
    target = ["--target", serving_stack.grpc_target, "--timeout", "30"]
    assert main(["client", "generate", *target, "--prompt", "Hello", "--max-tokens", "6", "--temperature", "0",
                 "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["text"] == expected.text and reply["finish_reason"] == "length"
    # Greedy by default, as `warpspec generate` is.
    assert main(["client", "generate", *target, "--prompt", "Hello", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected.text + "\n"
    assert main(["client", "health", *target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    with pytest.raises(SystemExit) as exit_:
        main(["client", "generate", *target, "--prompt", "Hello", "--max-tokens", "-1"])
    assert exit_.value.code == 2  # refused input, as everywhere on the command line
    assert "INVALID_ARGUMENT: params.max_tokens must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("ids", ["1,x", "1,,2", "1.5"])
def test_client_command_refuses_bad_token_ids_naming_the_flag(ids, capsys):
    """Refused before any call is made (no server at this address), exit 2 as for any refused input."""
    assert main(["client", "generate", "--target", "127.0.0.1:1", "--prompt-token-ids", ids]) == 2
    assert f"--prompt-token-ids must be comma-separated integers, got {ids!r}" in capsys.readouterr().err
