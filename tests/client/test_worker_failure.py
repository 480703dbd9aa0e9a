"""A worker killed mid-generation fails the in-flight work promptly and clearly, never hangs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from helpers.hf_checkpoints import make_text_checkpoint
from helpers.waiting import free_cpus, wait_for_cpus
from warpspec import LLM, SamplingParams
from warpspec.errors import WorkerDiedError


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_worker_fails_generation_within_seconds(ray_cluster, tmp_path):
    path = make_text_checkpoint(tmp_path / "ckpt", max_position_embeddings=4096)
    cpus_before = free_cpus(ray_cluster)
    llm = LLM(str(path), dtype="float32", num_workers=2)
    pids = llm.engine.coordinator.worker_pids()
    result: dict = {}

    def generate() -> None:
        try:
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
        except Exception as e:  # noqa: BLE001 - the test inspects what came out
            result["error"] = e
        result["done_at"] = time.monotonic()

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(2.0)  # well into decoding
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive(), "generation hung after a worker died"
    assert isinstance(result.get("error"), WorkerDiedError), result
    assert result["done_at"] - killed_at < 10
    assert "worker of this replica died" in str(result["error"])
    # Nothing is left waiting, and the broken replica refuses new work at once.
    assert not llm.engine.has_unfinished()
    with pytest.raises(WorkerDiedError):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    llm.shutdown()
    deadline = time.monotonic() + 10
    while _is_alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _is_alive(pids[0])
    wait_for_cpus(ray_cluster, cpus_before)


def test_killed_coordinator_fails_generation_and_shutdown_releases_its_placement_group(ray_cluster, tmp_path):
    """Ray keeps a placement group until the job or detached actor that made it ends: the workers'
    group is made beside the coordinator's handle, so a dead coordinator's group can still be removed."""
    import ray

    def live_groups() -> int:
        return sum(1 for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED")

    path = make_text_checkpoint(tmp_path / "ckpt", max_position_embeddings=4096)
    groups_before, cpus_before = live_groups(), free_cpus(ray_cluster)
    llm = LLM(str(path), dtype="float32", num_workers=2)
    assert live_groups() == groups_before + 1
    worker_pids, coordinator_pid = llm.engine.coordinator.worker_pids(), llm.engine.coordinator.coordinator_pid()
    os.kill(coordinator_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(WorkerDiedError, match="coordinator died"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert time.monotonic() - killed_at < 10
    llm.shutdown()
    deadline = time.monotonic() + 10
    while (live_groups() > groups_before or any(map(_is_alive, worker_pids))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_groups() == groups_before
    assert not any(map(_is_alive, worker_pids))
    wait_for_cpus(ray_cluster, cpus_before)
