"""Serving on a simulated multi-node Ray cluster (raylets on this machine): where replicas land, a
replica no node can hold, a node lost under load, and nodes the autoscaler adds and removes. The
scenarios live in multi_node_scenarios.py and run in processes of their own (a process holds one Ray
connection; the other serving tests share another); each asserts what it must and reports what it
saw as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCENARIOS = Path(__file__).with_name("multi_node_scenarios.py")


def run_scenario(name: str) -> dict:
    result = subprocess.run([sys.executable, str(SCENARIOS), name], capture_output=True, text=True, timeout=400,
                            env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})
    assert result.returncode == 0, result.stderr[-4000:]
    prefix = "scenario result: "
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith(prefix))[len(prefix):])


@pytest.fixture(scope="module")
def nodes_report() -> dict:
    """The three scenarios of one cluster of 2 worker nodes (nodes_scenario), run once for their tests."""
    return run_scenario("nodes")


def test_each_replica_and_its_ranks_share_one_node_and_replicas_spread(nodes_report):
    report = nodes_report["placement"]
    assert report["num_tokens"] == 16


def test_a_replica_no_node_can_hold_fails_naming_each_node(nodes_report):
    report = nodes_report["infeasible"]
    message = report["message"]
    assert "needs CPU 3, GPU 0 on one node" in message and "no node is large enough" in message
    assert message.count("CPU 2, GPU 0") == 2 and "CPU 1, GPU 0" in message  # the 2 workers and the head
    assert report["seconds"] < 30 and report["placement_groups"] == 0  # the probe is gone


def test_losing_a_node_fails_its_streams_only_and_serve_restarts_its_replica(nodes_report):
    report = nodes_report["node_loss"]
    assert report["lost_ended_after_s"] < 10
    assert report["placement_groups"] == 2


def test_a_replica_on_a_node_that_never_compiled_fetches_the_first_replicas_steps():
    report = run_scenario("compile_cache")  # the scenario asserts the store's record of both start-ups
    assert report["graphs"][0] == report["graphs"][1] > 0  # every graph compiled once was loaded
    assert report["files"] > 0


def test_load_beyond_one_replica_adds_a_node_and_removes_it_after():
    """Ray's fake multi-node provider as the autoscaler's cloud (the same upscaling mode, Default, as
    k8s/rayservice.yaml; an idle timeout of 6 s instead of its 600): a second replica's gang fits no
    node until the autoscaler adds one; after the load the replica and then the node go."""
    report = run_scenario("autoscaling")
    assert report["node_added_s"] < report["second_replica_serving_s"]
    assert report["replica_removed_s"] < report["node_removed_s"]
