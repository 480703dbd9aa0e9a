"""Start-up, phase by phase (core/startup.py): each front end reports what its engine did before the
first request, in order and timed, for an engine in this process and one in a coordinator actor."""

from __future__ import annotations

import time

import pytest

from helpers.eagle3_checkpoints import make_speculation_draft, make_speculation_target
from warpspec import LLM, SamplingParams
from warpspec.core.startup import StartupPhase, StartupTimer, startup_table
from warpspec.core.warm_up import WARM_UP_PROMPT_TOKENS


def test_phases_are_kept_in_order_with_their_time_and_what_they_did():
    timer = StartupTimer()
    with timer.phase("weights and KV cache") as phase:
        time.sleep(0.02)
        phase.detail = "1 rank"
    with timer.phase("draft"):
        pass
    assert [(p.name, p.detail) for p in timer.phases] == [("weights and KV cache", "1 rank"), ("draft", "")]
    assert timer.phases[0].seconds >= 0.02 and timer.total_s >= timer.phases[0].seconds
    table = startup_table(timer.phases + [StartupPhase("warm-up request", 0.5)]).splitlines()
    assert table[2].startswith("| weights and KV cache | 0.0") and table[-1].startswith("| total | 0.5")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_speculation_target(tmp_path_factory.mktemp("target")), \
        make_speculation_draft(tmp_path_factory.mktemp("draft"))


def test_an_engine_in_this_process_reports_its_weights_and_its_draft(pair):
    target, draft = pair
    with LLM(str(target), dtype="float32", draft=str(draft), enforce_eager=True) as llm:
        phases = llm.startup
        stats, step_budget = llm.engine.stats(), llm.engine.config.scheduler.max_num_batched_tokens
    # Eager: nothing compiles; the adaptive draft length times the steps it chooses between.
    assert [p.name for p in phases] == ["weights and KV cache", "draft", "warm-up prompt", "time steps"]
    assert phases[0].detail.startswith("1 rank, ") and all(p.seconds > 0 for p in phases)
    # The stand-in prompt: as long as the step budget allows (WARM_UP_PROMPT_TOKENS at most), and gone.
    assert phases[2].detail == f"{min(WARM_UP_PROMPT_TOKENS, step_budget)} tokens"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0


@pytest.mark.slow
def test_an_engine_on_ray_reports_placement_the_coordinators_start_and_its_phases(ray_cluster, pair):
    target, draft = pair
    with LLM(str(target), dtype="float32", draft=str(draft), num_workers=1, executor="ray",
             enforce_eager=True) as llm:
        phases = llm.startup
        # The coordinator's batch forgot the stand-in prompt: a request runs beside nothing.
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    assert [p.name for p in phases] == ["placement", "coordinator process", "weights and KV cache", "draft",
                                        "warm-up prompt", "time steps"]
    assert phases[2].detail.startswith("1 rank, ") and all(p.seconds >= 0 for p in phases)
