"""The engine core's step on its own, over a LocalExecutor in this process: what a step returns, how
requests finish, what abort frees, and what a failed step does to the batch."""

import pytest

from warpspec import SamplingParams
from warpspec.config.options import engine_config
from warpspec.core.engine_core import EngineCore
from warpspec.errors import EngineError, InvalidRequestError, StepFailedError
from warpspec.executor.local import LocalExecutor
from warpspec.training.random_checkpoint import create_random_checkpoint


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    config = engine_config(str(create_random_checkpoint(tmp_path_factory.mktemp("core"), "tiny", std=0.3)),
                           dtype="float32")
    core = EngineCore(config, LocalExecutor(config))
    yield core
    core.shutdown()


def add(core: EngineCore, request_id: str, prompt: list[int], **params) -> None:
    core.add_request(core.new_request(request_id, prompt, SamplingParams(temperature=0, **params)))


def run(core: EngineCore) -> dict[str, list]:
    """Step until nothing is unfinished: every request's deltas, in step order."""
    deltas: dict[str, list] = {}
    while core.has_unfinished():
        for delta in core.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def test_each_step_returns_a_delta_per_request_that_gained_tokens_and_length_ends_them(core):
    add(core, "a", [5, 6, 7], max_tokens=3, ignore_eos=True)
    add(core, "b", [8, 9], max_tokens=1, ignore_eos=True)
    deltas = run(core)
    # a: the prefill's token, then 2 decodes; b ends with its first token.
    assert [len(d.new_token_ids) for d in deltas["a"]] == [1, 1, 1] and len(deltas["b"]) == 1
    assert [d.finish_reason for d in deltas["a"]] == [None, None, "length"] and deltas["b"][0].finish_reason == "length"
    # Metrics ride on the first delta and the last, not between.
    assert deltas["a"][0].metrics and not deltas["a"][1].metrics and deltas["a"][2].metrics
    assert core.stats().num_free_kv_blocks == core.stats().num_kv_blocks  # finished requests hold nothing


def test_a_stop_token_ends_a_request_with_that_token_as_its_reason(core):
    add(core, "free", [5, 6, 7], max_tokens=4, ignore_eos=True)
    first = run(core)["free"][1].new_token_ids[0]  # the greedy second token
    add(core, "stopped", [5, 6, 7], max_tokens=4, ignore_eos=True, stop_token_ids=[first])
    last = run(core)["stopped"][-1]
    assert (last.finish_reason, last.stop_reason, last.new_token_ids) == ("stop", first, [first])


def test_a_request_id_in_flight_is_refused_and_abort_frees_its_blocks_at_once(core):
    add(core, "x", [1, 2, 3, 4, 5], max_tokens=8)
    with pytest.raises(InvalidRequestError, match="request_id 'x' is already in flight"):
        add(core, "x", [1, 2], max_tokens=2)
    core.step()
    assert core.stats().num_free_kv_blocks < core.stats().num_kv_blocks
    core.abort("x")
    core.abort("never-added")  # unknown (or finished meanwhile): ignored
    assert not core.has_unfinished() and core.stats().num_free_kv_blocks == core.stats().num_kv_blocks


def test_a_failed_step_aborts_its_requests_only_and_a_dead_executor_drops_every_request(core, monkeypatch):
    execute = core.executor.execute

    def fail(plan):
        raise RuntimeError("bad tensor")

    add(core, "doomed", [1, 2, 3], max_tokens=4)
    monkeypatch.setattr(core.executor, "execute", fail)
    with pytest.raises(StepFailedError, match=r"failed \(RuntimeError: bad tensor\)") as failed:
        core.step()
    assert failed.value.request_ids == ["doomed"] and not core.has_unfinished()

    def die(plan):
        raise EngineError("the workers are gone")

    add(core, "one", [1, 2, 3], max_tokens=4)
    add(core, "two", [4, 5], max_tokens=4)
    monkeypatch.setattr(core.executor, "execute", die)
    with pytest.raises(EngineError, match="the workers are gone"):
        core.step()
    assert not core.has_unfinished() and not core.requests
    monkeypatch.setattr(core.executor, "execute", execute)
    add(core, "after", [1, 2, 3], max_tokens=2)  # the core itself goes on
    assert len(run(core)["after"]) == 2
