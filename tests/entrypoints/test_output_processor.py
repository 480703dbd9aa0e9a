"""The front end's output processor: the engine core sends token ids, and text, stop strings and the
tokens of logprobs are decoded here; a stop string aborts its request in the core."""

from __future__ import annotations

import pytest

from warpspec import LLM, SamplingParams
from warpspec.assets import BUNDLED_DRAFT, BUNDLED_TARGET
from warpspec.core.messages import RequestDelta
from warpspec.core.requests import NewRequest
from warpspec.entrypoints.output_processor import OutputProcessor
from warpspec.outputs import Logprob
from warpspec.tokenizer import IncrementalDetokenizer, Tokenizer
from warpspec.training.random_checkpoint import create_random_checkpoint

PROMPT = [1, 40, 41]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", std=0.3)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(BUNDLED_TARGET)  # whole words: "the", " kernel", " module", ...


def _pieces(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    """The text each token adds, as the processor's detokenizer sees it."""
    detokenizer = IncrementalDetokenizer(tokenizer, PROMPT, skip_special_tokens=True)
    return [detokenizer.add([t]) for t in token_ids]


def _visible_tokens(tokenizer: Tokenizer, n: int) -> tuple[list[int], list[str]]:
    """The first n tokens of a sentence, each adding at least two characters."""
    ids = tokenizer.encode("the kernel module reads the driver and then the device file appears")[1:]
    pieces = _pieces(tokenizer, ids)
    assert all(len(p) >= 2 for p in pieces[:n]), pieces
    return ids[:n], pieces[:n]


def _processor(tokenizer, **params):
    aborted = []
    processor = OutputProcessor(tokenizer, aborted.append)
    processor.add(NewRequest("r", None, PROMPT, SamplingParams(max_tokens=16, **params), seed=0))
    return processor, aborted


def _logprobs(token_ids):
    return [{t: Logprob(-0.5, 1)} for t in token_ids]


def test_a_stop_string_spanning_two_tokens_cuts_the_text_and_aborts_in_the_core(tokenizer):
    # pieces "the", " kernel", ...: a stop string of the last char of one and the first of the next
    ids, pieces = _visible_tokens(tokenizer, 4)
    stop = pieces[1][-1] + pieces[2][0]
    processor, aborted = _processor(tokenizer, stop=[stop])
    first = processor.process([RequestDelta("r", ids[:1], metrics={"prompt_tokens": 3}),
                               RequestDelta("not-here", [5])])  # an aborted request's delta is dropped
    assert [o.request_id for o in first] == ["r"] and first[0].new_text == pieces[0] and not first[0].finished
    second = processor.process([RequestDelta("r", ids[1:2])])[0]
    assert second.new_text == pieces[1] and not aborted  # the first half of the stop string is streamed
    third = processor.process([RequestDelta("r", ids[2:3])])[0]
    assert (third.finish_reason, third.stop_reason) == ("stop", stop)
    assert third.token_ids == ids[:3]  # the token that completed the stop string is kept
    assert third.text == (pieces[0] + pieces[1])[:-1]  # cut before the stop string
    assert aborted == ["r"]  # the core had not finished it: its KV blocks must go
    assert processor.process([RequestDelta("r", ids[3:4])]) == []  # the core's next step is unseen


def test_a_stop_string_inside_a_speculative_step_drops_the_later_tokens_and_their_logprobs(tokenizer):
    ids, pieces = _visible_tokens(tokenizer, 5)
    stop = pieces[2][:2]
    processor, aborted = _processor(tokenizer, stop=[stop], logprobs=0)
    processor.process([RequestDelta("r", ids[:1], new_logprobs=_logprobs(ids[:1]),
                                    metrics={"prompt_tokens": 3, "cached_prompt_tokens": 0, "queue_time_s": 0.1})])
    # One verification: 3 drafts all accepted plus the bonus, and the stop string in the second.
    out = processor.process([RequestDelta("r", ids[1:5], new_logprobs=_logprobs(ids[1:5]), num_draft_tokens=3)])[0]
    assert out.token_ids == ids[:3] and out.new_token_ids == ids[1:3]  # ids[3], ids[4] are dropped
    assert [list(p) for p in out.logprobs] == [[t] for t in ids[:3]]  # and so are their logprobs
    assert out.logprobs[1][ids[1]].decoded_token == tokenizer.token_text(ids[1])  # decoded here
    assert out.text == pieces[0] + pieces[1] and out.stop_reason == stop and aborted == ["r"]
    # The counts the core would have given: 3 tokens, one verification of 3 drafts accepting 3.
    assert out.metrics["completion_tokens"] == 3 and out.metrics["cached_prompt_tokens"] == 0
    assert (out.metrics["draft_tokens"], out.metrics["accepted_draft_tokens"], out.metrics["acceptance_length"]) == (
        3, 3, 4.0)


def test_a_stop_string_before_the_cores_own_finish_wins_without_an_abort(tokenizer):
    ids, pieces = _visible_tokens(tokenizer, 4)
    processor, aborted = _processor(tokenizer, stop=[pieces[1]])
    metrics = {"prompt_tokens": 3, "completion_tokens": 4, "time_per_output_token_s": 0.3}
    out = processor.process([RequestDelta("r", ids, "length", metrics=metrics)])[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == ("stop", pieces[1], ids[:2], pieces[0])
    assert not aborted  # the core finished it itself
    # The core's metrics, over the tokens kept: 2, and the same span 3 x 0.3 s over one interval.
    assert out.metrics["completion_tokens"] == 2 and out.metrics["time_per_output_token_s"] == pytest.approx(0.9)


def test_a_stop_string_aborts_in_the_core_and_its_blocks_free_before_the_next_step(checkpoint):
    with LLM(str(checkpoint), dtype="float32", max_model_len=256) as llm:
        free = llm.generate("import os", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
        stop = free.text[6:9]
        engine, aborted = llm.engine, []
        processor = OutputProcessor(engine.tokenizer, lambda request_id: (aborted.append(request_id),
                                                                          engine.abort(request_id)))
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        stopped = engine.new_request("stopped", "import os", params)
        other = engine.new_request("other", "def main():", SamplingParams(max_tokens=24, ignore_eos=True))
        for request in (stopped, other):
            processor.add(request)
            engine.add_request(request)
        final = None
        while final is None:
            final = next((o for o in processor.process(engine.step()) if o.request_id == "stopped" and o.finished),
                         None)
        # Before any further step: the core has dropped the request and its blocks are free, and only
        # the other request's remain.
        assert aborted == ["stopped"] and "stopped" not in engine.requests
        blocks = engine.block_manager
        assert set(blocks.block_tables) == {"other"}
        assert blocks.num_free_blocks == blocks.num_blocks - sum(blocks.blocks_held())
        assert final.text == free.text[: free.text.index(stop)] and final.stop_reason == stop
        assert final.token_ids == free.token_ids[: len(final.token_ids)]
        while engine.has_unfinished():
            processor.process(engine.step())
        assert blocks.num_free_blocks == blocks.num_blocks


def test_stop_strings_with_speculation_read_as_without(tmp_path):
    """Greedy with an EAGLE-3 draft gives the same tokens, text and logprobs as without one, for stop
    strings anywhere; at least one of them is found inside a verification that accepted drafts past
    it, which the core had already appended and the front end drops."""
    prompt = "The kernel"
    plain = SamplingParams(max_tokens=40, temperature=0, logprobs=1)
    with LLM(str(BUNDLED_TARGET), dtype="float32") as llm:
        free = llm.generate(prompt, plain)[0]
        stops = [free.text[a : a + 3] for a in range(2, len(free.text) - 3, 5)]
        expected = [llm.generate(prompt, SamplingParams(**{**vars(plain), "stop": [s]}))[0] for s in stops]
    with LLM(str(BUNDLED_TARGET), dtype="float32", draft=str(BUNDLED_DRAFT), num_speculative_tokens=3,
             compile_draft=False) as llm:
        engine, num_dropped = llm.engine, []
        abort = llm.output_processor.abort_in_core

        def abort_and_count(request_id):
            num_dropped.append(len(engine.requests[request_id].output_token_ids))
            abort(request_id)

        llm.output_processor.abort_in_core = abort_and_count
        got = [llm.generate(prompt, SamplingParams(**{**vars(plain), "stop": [s]}))[0] for s in stops]
    for stop, want, out in zip(stops, expected, got, strict=True):
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), stop
        assert len(out.logprobs) == len(out.token_ids)
        for got_position, want_position in zip(out.logprobs, want.logprobs, strict=True):
            assert got_position.keys() == want_position.keys()
            assert all(got_position[t].decoded_token == want_position[t].decoded_token for t in got_position)
    stopped = [out for out in got if isinstance(out.stop_reason, str)]
    assert len(num_dropped) == len(stopped) and any(
        core > len(out.token_ids) for core, out in zip(num_dropped, stopped, strict=True))


def test_a_stop_string_through_ray_reads_as_in_process(ray_cluster, checkpoint):
    """Over one Ray worker the core in the coordinator sends token ids only; the replica finds the
    stop string and the core drops the request on the abort that follows."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(str(checkpoint), dtype="float32", max_model_len=256) as llm:
        free = llm.generate("import os", params)[0]
        stop = free.text[6:9]
        stopped_params = SamplingParams(**{**vars(params), "stop": [stop]})
        want = llm.generate("import os", stopped_params)[0]
    with LLM(str(checkpoint), dtype="float32", max_model_len=256, num_workers=1, executor="ray") as llm:
        out = llm.generate("import os", stopped_params)[0]
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
            want.token_ids, want.text, "stop", stop)
        assert [{t: lp.decoded_token for t, lp in p.items()} for p in out.logprobs] == [
            {t: lp.decoded_token for t, lp in p.items()} for p in want.logprobs]
        assert out.metrics["completion_tokens"] == len(want.token_ids)
        llm.generate([1, 2], SamplingParams(max_tokens=1))  # a reply after the abort has been applied
        stats = llm.engine.stats()
        assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
