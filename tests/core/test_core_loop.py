"""The engine core's loop with no Ray: CoreLoop(EngineCore(LocalExecutor)) built and stepped here, as
the coordinator actor hosts it."""

import pytest

from warpspec import LLM, SamplingParams
from warpspec.config.options import engine_config
from warpspec.core.core_loop import CoreLoop
from warpspec.core.engine_core import EngineCore
from warpspec.core.messages import CoreInput
from warpspec.executor.local import LocalExecutor
from warpspec.training.random_checkpoint import create_random_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7], "b": [8, 9, 10, 11]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("core-loop"), "tiny", std=0.3)


@pytest.fixture(scope="module")
def expected(checkpoint):
    """Each prompt's tokens from the offline LLM (an EngineCore stepped in its process)."""
    with LLM(str(checkpoint), dtype="float32") as llm:
        outputs = llm.generate(list(PROMPTS.values()), GREEDY)
    return {request_id: out.token_ids for request_id, out in zip(PROMPTS, outputs, strict=True)}


def make_loop(checkpoint, reply_interval_ms: float = 0.0, on_pass=None) -> CoreLoop:
    config = engine_config(str(checkpoint), dtype="float32")
    return CoreLoop(EngineCore(config, LocalExecutor(config)), reply_interval_ms, on_pass)


def add(loop: CoreLoop, number: int, request_ids: list[str], aborts: list[str] = ()) -> None:
    adds = [loop.core.new_request(request_id, PROMPTS[request_id], GREEDY) for request_id in request_ids]
    loop.submit(CoreInput(number, adds, list(aborts)))


def collect(replies, num_finished: int) -> tuple[dict[str, list[int]], list]:
    """Read replies until num_finished requests have finished: each request's tokens, and the replies."""
    tokens, finished, seen = {}, set(), []
    for reply in replies:
        seen.append(reply)
        for delta in reply.deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                finished.add(delta.request_id)
        if len(finished) == num_finished:
            return tokens, seen
    raise AssertionError("the loop ended before every request finished")


def test_the_loop_steps_its_requests_to_the_offline_tokens_and_close_ends_it(checkpoint, expected):
    passes = []
    loop = make_loop(checkpoint, on_pass=passes.append)
    add(loop, 0, ["a", "b"])
    replies = loop.run()
    tokens, seen = collect(replies, num_finished=2)
    assert tokens == expected
    # One reply a step with no interval: a prefill, then max_tokens - 1 decodes of both requests.
    assert len(seen) == GREEDY.max_tokens and len(passes) == GREEDY.max_tokens
    assert seen[-1].stats.num_running == 0 and seen[-1].stats.num_free_kv_blocks == seen[-1].stats.num_kv_blocks
    loop.close(wait_s=5)
    assert list(replies) == []  # idle and closed: the loop ends instead of waiting


def test_middle_steps_merge_into_one_reply_within_the_interval(checkpoint, expected):
    """reply_interval_ms of an hour: the first tokens and the end go at once, the steps between wait and merge."""
    loop = make_loop(checkpoint, reply_interval_ms=3_600_000)
    add(loop, 0, ["a"])
    tokens, seen = collect(loop.run(), num_finished=1)
    loop.close(wait_s=5)
    assert tokens == {"a": expected["a"]}
    # [first token] [tokens 2..6 merged, finished]: 2 replies for 6 steps.
    assert [len(r.deltas[0].new_token_ids) for r in seen] == [1, GREEDY.max_tokens - 1]


def test_an_add_the_core_refuses_fails_alone_and_an_abort_frees_blocks(checkpoint, expected):
    loop = make_loop(checkpoint)
    replies = loop.run()
    add(loop, 0, ["a", "b"])
    first = next(replies)  # the prefill of both
    assert {d.request_id for d in first.deltas} == {"a", "b"}
    # "a" again while in flight: the core refuses it in the reply and goes on; then "b" is aborted.
    add(loop, 1, ["a"], aborts=["b"])
    tokens, seen = collect(replies, num_finished=1)
    loop.close(wait_s=5)
    failures = [f for reply in seen for f in reply.failures]
    assert len(failures) == 1 and failures[0].request_ids == ["a"] and "already in flight" in str(failures[0])
    assert "b" not in tokens and tokens["a"] == expected["a"][1:]  # the first token came with `first`
    assert seen[-1].stats.num_free_kv_blocks == seen[-1].stats.num_kv_blocks


def test_close_waits_for_the_pass_in_progress_at_most_its_limit(checkpoint):
    loop = make_loop(checkpoint)
    with loop.is_stepping:  # a pass that never ends (a hung collective)
        loop.close(wait_s=0.05)
    assert loop.inbox.take(wait=True) is None
