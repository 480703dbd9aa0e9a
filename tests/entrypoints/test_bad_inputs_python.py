"""The bad-input matrix of the Python entry points (SamplingParams, LLM.generate) and the checkpoint
loader: each row is one wrong thing a user can hand in, the exception it must raise, and a fragment
of the message naming the field. After the matrix the same LLM still generates correctly.

The network entry points (gRPC, HTTP) have their own matrix in tests/serving/test_bad_inputs.py."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from helpers.eagle3_checkpoints import make_eagle3_checkpoint
from warpspec import InvalidRequestError, SamplingParams
from warpspec.entrypoints.llm import LLM
from warpspec.training.random_checkpoint import create_random_checkpoint
from warpspec.workers.errors import CheckpointError

MAX_MODEL_LEN = 64
VOCAB = 512  # the tiny preset

# (SamplingParams kwargs, message fragment). Every row raises InvalidRequestError (a ValueError).
SAMPLING_ROWS = [
    ({"max_tokens": "16"}, "max_tokens must be an integer, got '16'"),
    ({"max_tokens": 16.0}, "max_tokens must be an integer"),
    ({"max_tokens": True}, "max_tokens must be an integer, got True"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": -3}, "max_tokens must be >= 1"),
    ({"max_tokens": 10**30}, "max_tokens must be <= 2147483647"),
    ({"temperature": math.nan}, "temperature must be finite, got nan"),
    ({"temperature": math.inf}, "temperature must be finite, got inf"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"temperature": None}, "temperature must be a number, got None"),
    ({"top_p": math.nan}, "top_p must be finite"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be >= -1"),
    ({"top_k": 2**40}, "top_k must be <= 2147483647"),
    ({"min_p": -math.inf}, "min_p must be finite"),
    ({"min_p": 2.0}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty must be finite"),
    ({"seed": -1}, "seed must be >= 0"),
    ({"seed": 2**64}, "seed must be <= 9223372036854775807"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"stop": ["x"] * 1000}, "stop has 1000 strings; at most 64"),
    ({"stop": ["x" * 1000]}, "stop strings must be at most 256 characters, got one of 1000"),
    ({"stop": [""]}, "stop strings must be non-empty strings"),
    ({"stop": [5]}, "stop strings must be non-empty strings, got 5"),
    ({"stop": 5}, "stop must be a string or a list of strings, got int"),
    ({"stop": {"a": 1}}, "stop must be a string or a list of strings, got dict"),
    ({"stop_token_ids": [7] * 1000}, "stop_token_ids has 1000 ids; at most 256"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids must be an integer"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of integers, got int"),
    ({"logprobs": 21}, "logprobs must be at most 20, got 21"),
    ({"logprobs": -1}, "logprobs must be >= 0"),
    ({"prompt_logprobs": 10**9}, "prompt_logprobs must be at most 20"),
]


@pytest.mark.parametrize("kwargs, fragment", SAMPLING_ROWS, ids=[f"{k}" for k, _ in SAMPLING_ROWS])
def test_sampling_params_rows(kwargs, fragment):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**kwargs)
    assert fragment in str(error.value)


def test_tiny_temperatures_sample_greedily():
    # Dividing logits by 1e-30 overflows float32 to inf, and the softmax of inf - inf is NaN, which
    # used to fail the engine step (and with it every request in the batch).
    assert SamplingParams(temperature=1e-30).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("bad-inputs") / "tiny", "tiny", std=0.3)


@pytest.fixture(scope="module")
def llm(target):
    with LLM(str(target), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=16) as llm:
        yield llm


GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
# (prompts, params, exception, message fragment)
GENERATE_ROWS = [
    ("", GREEDY, InvalidRequestError, "prompt 0: prompt is empty"),
    ([[]], GREEDY, InvalidRequestError, "prompt 0: prompt is empty"),
    ([[5] * (MAX_MODEL_LEN + 1)], GREEDY, InvalidRequestError, f"prompt has {MAX_MODEL_LEN + 1} tokens; max_model_len"),
    ([[5, VOCAB]], GREEDY, InvalidRequestError, f"prompt token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ([[5, -1]], GREEDY, InvalidRequestError, "prompt token id -1 is outside the vocabulary"),
    ([[5, 2**70]], GREEDY, InvalidRequestError, "is outside the vocabulary"),
    ([[5, 1.0]], GREEDY, InvalidRequestError, "prompt token id 1.0 is outside the vocabulary"),
    ([["a", "b"]], GREEDY, InvalidRequestError, "prompt token id 'a' is outside the vocabulary"),
    ([None], GREEDY, InvalidRequestError, "prompt must be a string or a list of token ids, got NoneType"),
    (5, GREEDY, InvalidRequestError, "prompts must be a string, a list of token ids or a list of prompts, got int"),
    (None, GREEDY, InvalidRequestError, "prompts must be a string"),
    (["a", "b"], [GREEDY], InvalidRequestError, "got 1 sampling params for 2 prompts"),
    (["a"], {"max_tokens": 4}, InvalidRequestError, "sampling params must be SamplingParams, got dict"),
]


@pytest.mark.parametrize("prompts, params, exception, fragment", GENERATE_ROWS,
                         ids=[r[3][:40] for r in GENERATE_ROWS])
def test_generate_rows(llm, prompts, params, exception, fragment):
    with pytest.raises(exception) as error:
        llm.generate(prompts, params)
    assert fragment in str(error.value)


def test_the_llm_still_serves_after_the_matrix(llm, target):
    """Last in the module: nothing above left a request behind or broke the engine."""
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and engine.num_waiting == 0
    # The same request on a fresh engine: the reference the survivor must still match.
    with LLM(str(target), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=16) as fresh:
        expected = fresh.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
    assert llm.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids == expected
    # Extreme but valid temperatures sample without NaN.
    for temperature in (1e-30, 1e30):
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and all(0 <= t < VOCAB for t in out.token_ids)


# ---- the loader: bad checkpoints and drafts ------------------------------------------------------------

def _copy(target, tmp_path, name="ckpt"):
    return shutil.copytree(target, tmp_path / name)


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _corrupt_header(path):
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    (path / "model.safetensors").write_bytes(bytes(data))


def _huge_header_length(path):
    data = bytearray((path / "model.safetensors").read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    (path / "model.safetensors").write_bytes(bytes(data))


def _empty_file(path):
    (path / "model.safetensors").write_bytes(b"")


def _remove_weights(path):
    (path / "model.safetensors").unlink()


def _bad_config_json(path):
    (path / "config.json").write_text("{not json")


def _config_hidden_size(value):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        config["hidden_size"] = value
        (path / "config.json").write_text(json.dumps(config))
    return edit


# (name, how to break a copy of the target, exception, message fragment)
LOADER_ROWS = [
    ("truncated", _truncate, CheckpointError, "corrupt or unreadable safetensors file"),
    ("corrupt header", _corrupt_header, CheckpointError, "corrupt or unreadable safetensors file"),
    ("huge header length", _huge_header_length, CheckpointError, "corrupt or unreadable safetensors file"),
    ("empty file", _empty_file, CheckpointError, "corrupt or unreadable safetensors file"),
    ("no weights", _remove_weights, CheckpointError, "has neither model.safetensors"),
    ("config not JSON", _bad_config_json, CheckpointError, "config.json"),
    ("config hidden_size wrong", _config_hidden_size(96), CheckpointError, "shape"),
    ("config hidden_size negative", _config_hidden_size(-64), CheckpointError, "hidden_size"),
]


@pytest.mark.parametrize("name, breaker, exception, fragment", LOADER_ROWS, ids=[r[0] for r in LOADER_ROWS])
def test_loader_rows(target, tmp_path, name, breaker, exception, fragment):
    path = _copy(target, tmp_path)
    breaker(path)
    with pytest.raises(exception) as error:
        LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=16)
    assert fragment in str(error.value)
    assert "Traceback" not in str(error.value)


def test_unknown_model_paths_and_mismatched_drafts(target, tmp_path):
    with pytest.raises(CheckpointError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"), dtype="float32")
    draft = make_eagle3_checkpoint(tmp_path / "draft", hidden=32, vocab=VOCAB, draft_vocab=64)
    with pytest.raises(CheckpointError, match="draft expects target hidden size 32, the target has 64"):
        LLM(str(target), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=16, draft=str(draft),
            compile_draft=False)
    with pytest.raises(CheckpointError, match="no-such-draft"):
        LLM(str(target), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=16,
            draft=str(tmp_path / "no-such-draft"), compile_draft=False)


def test_a_token_budget_that_cannot_hold_a_verification_is_refused(target, tmp_path):
    """A verification runs the last token and all k drafts in one step or waits (scheduler.py): a
    budget under k + 1 would wait forever, so it is refused before anything loads."""
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least num_speculative_tokens "
                                         r"\+ 1 = 5 when speculating, got 4"):
        LLM(str(target), dtype="float32", draft=str(tmp_path / "never-read"), num_speculative_tokens=4,
            max_num_batched_tokens=4)


def test_kv_cache_bad_inputs_are_refused_before_any_weight_loads(target, tmp_path):
    """A max_model_len one sequence cannot fit in every KV group at once, and chunked layers without a
    chunk: the checkpoint has no weights, so each error comes before the loader looks for them."""
    path = _copy(target, tmp_path)
    _remove_weights(path)
    # The tiny preset: 4 layers (1 NoPE), chunk 64, blocks of 16, 16 blocks of every layer = 64 of the
    # hybrid cache's. 512 tokens take 32 blocks in the full group, and in each chunked group the chunk
    # and a step of 2,048 tokens (max_num_batched_tokens), capped at the same 32: 128 in all.
    with pytest.raises(ValueError, match=r"max_model_len 512 needs 128 \(full attention 32, 3 chunked attention "
                                         r"\(64\) groups 32 each\) KV blocks for one sequence but the cache has 64 "
                                         r"\(num_kv_blocks\)"):
        LLM(str(path), dtype="float32", max_model_len=512, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"max_model_len 512 needs 32 KV blocks .* the cache has 16"):
        LLM(str(path), dtype="float32", max_model_len=512, num_kv_blocks=16, hybrid_kv_cache=False)
    config = json.loads((path / "config.json").read_text())
    for chunk in (None, 0):
        (path / "config.json").write_text(json.dumps({**config, "attention_chunk_size": chunk}))
        with pytest.raises(CheckpointError, match=r"attention_chunk_size must be a positive integer when layers use "
                                                  r"chunked attention \(no_rope_layers marks layers \[0, 1, 2\]\)"):
            LLM(str(path), dtype="float32")
