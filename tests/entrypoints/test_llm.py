"""The offline LLM API: stopping rules, seeds, logprobs, limits and bad requests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from warpspec import LLM, InvalidRequestError, SamplingParams
from warpspec.training.random_checkpoint import create_random_checkpoint

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", std=0.3)


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), dtype="float32", max_model_len=256) as llm:
        yield llm


def test_text_prompt_round_trips_through_the_tokenizer(llm):
    out = llm.generate("def main():", GREEDY)[0]
    assert out.prompt == "def main():"
    assert out.prompt_token_ids == llm.tokenizer.encode("def main():")
    assert out.prompt_token_ids[0] == 1  # the tokenizer adds <|begin_of_text|>
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_stop_string_is_cut_from_the_text(llm):
    free = llm.generate("import os", GREEDY)[0]
    stop = free.text[6:9]
    assert len(stop) == 3 and stop.strip(), f"pick a visible stop string from {free.text!r}"
    out = llm.generate("import os", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert out.text == free.text[: free.text.index(stop)]


def test_stop_token_ids_and_eos(checkpoint, llm):
    free = llm.generate([1, 50, 60], GREEDY)[0]
    stop_token = free.token_ids[4]
    first = free.token_ids.index(stop_token)
    out = llm.generate([1, 50, 60], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token]))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    # The same token declared as eos in generation_config.json stops generation unless ignore_eos.
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop_token]}))
    with LLM(str(checkpoint), dtype="float32", max_model_len=256) as eos_llm:
        stopped = eos_llm.generate([1, 50, 60], SamplingParams(max_tokens=24, temperature=0))[0]
        ignored = eos_llm.generate([1, 50, 60], GREEDY)[0]
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == free.token_ids


def test_output_stops_at_max_model_len(checkpoint):
    with LLM(str(checkpoint), dtype="float32", max_model_len=16) as llm:
        out = llm.generate([1] + [40] * 9, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        with pytest.raises(InvalidRequestError, match="prompt has 16 tokens; max_model_len 16 leaves no room"):
            llm.generate([[5] * 16], GREEDY)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("x = 1", seeded)[0]
    others = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)
    batch = llm.generate(["for i in", "x = 1", "class A:"], [others, seeded, others])
    assert batch[1].token_ids == alone.token_ids
    other_seed = llm.generate("x = 1", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99,
                                                      ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


def test_logprobs_report_the_chosen_token_and_the_top_k(llm):
    out = llm.generate("while True:", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 8
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        assert position[token].rank == 1  # greedy picks the most likely token
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
        values = [lp.logprob for lp in sorted(position.values(), key=lambda lp: lp.rank)]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert position[token].decoded_token == llm.tokenizer.token_text(token)


@pytest.mark.parametrize("prompt,message", [
    ([], "prompt is empty"),
    ("", "prompt is empty"),
    ([1, 512], r"prompt token id 512 is outside the vocabulary \[0, 512\)"),
    ([1, -3], "prompt token id -3 is outside the vocabulary"),
    ([1, "a"], "prompt token id 'a' is outside the vocabulary"),
    (3.5, "prompt must be a string or a list of token ids"),
])
def test_bad_prompts_are_rejected_before_anything_runs(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([[1, 2, 3], prompt], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_request_that_can_never_fit_the_kv_cache(checkpoint):
    # The checkpoint's 4 layers keep a hybrid KV cache (chunk 64): a full-attention group and three
    # chunked groups, each with its own blocks, 4 x 3 in the memory of 3 blocks of every layer. 20
    # tokens take 5 blocks in every group.
    with LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=3) as llm:
        with pytest.raises(InvalidRequestError, match=r"needs 20 \(full attention 5, 3 chunked attention \(64\) "
                                                      r"groups 5 each\) KV blocks but the cache has only 12"):
            llm.generate([[1] * 10], SamplingParams(max_tokens=10))
        # Requests that fit one at a time all complete, queued behind each other.
        outs = llm.generate([[1] * 4, [2] * 5, [3] * 6], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [6, 6, 6]
        assert llm.engine.block_manager.num_free_blocks == 12
    full = LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=3, hybrid_kv_cache=False)
    with full, pytest.raises(InvalidRequestError, match="needs 5 KV blocks but the cache has only 3"):
        full.generate([[1] * 10], SamplingParams(max_tokens=10))


def test_shutdown_and_context_manager(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=64)
    with llm:
        assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].token_ids
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([1, 2])
    llm.shutdown()  # idempotent


def test_string_prompt_without_tokenizer(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(checkpoint / name)
    with LLM(str(bare), dtype="float32", max_model_len=64) as llm:
        with pytest.raises(InvalidRequestError, match="no tokenizer.json: pass prompts as token ids"):
            llm.generate("hello")
        out = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))[0]
        assert out.text == "" and len(out.token_ids) == 3


def test_one_local_worker_runs_without_importing_ray(checkpoint):
    """Ray costs seconds and hundreds of MB to import: an in-process engine (AsyncLLM too) has no use for it."""
    code = ("import asyncio, sys\n"
            "from warpspec import LLM, SamplingParams\n"
            "from warpspec.entrypoints.async_llm import AsyncLLM\n"
            f"llm = LLM({str(checkpoint)!r}, dtype='float32')\n"
            "assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2\n"
            f"engine = AsyncLLM.from_options({str(checkpoint)!r}, dtype='float32')\n"
            "async def main():\n"
            "    return [o async for o in engine.generate([1, 2], SamplingParams(max_tokens=2))]\n"
            "assert asyncio.run(main())[-1].finished\n"
            "print('ray' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
