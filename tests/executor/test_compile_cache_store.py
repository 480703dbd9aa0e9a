"""The cluster's compile cache (executor/compile_cache_store.py): the first process that compiles a
role's steps publishes them, the next one, with an empty folder of its own (a node that never
compiled), fetches them and compiles nothing; a bundle it must refuse is rebuilt and replaced. Each
process here is a real Ray actor with its own cache folder, as on separate nodes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray

from warpspec.config.engine import EngineConfig
from warpspec.executor.compile_cache_store import (
    compile_cache_events,
    compile_cache_key,
    compile_cache_store,
    shared_compile_cache,
)


@ray.remote(num_cpus=0)
class Compiler:
    """A process that warms up by compiling scale_and_shift into its own folder."""

    def __init__(self, folder: str, tests_dir: str):
        sys.path.insert(0, tests_dir)
        self.folder = Path(folder)

    def warm_up(self, key: str, fingerprint: dict[str, str]) -> None:
        from test_compile_cache import compile_once

        with shared_compile_cache(self.folder, key, fingerprint):
            compile_once(self.folder)


def warm_up_in_a_new_process(folder: Path, key: str, fingerprint: dict[str, str]):
    actor = Compiler.remote(str(folder), str(Path(__file__).parents[1] / "workers" / "compile"))
    ray.get(actor.warm_up.remote(key, fingerprint))
    ray.kill(actor)
    return next(e for e in reversed(compile_cache_events()) if e.key == key)


@pytest.mark.slow
def test_a_second_process_fetches_what_the_first_built_and_compiles_nothing(ray_cluster, tmp_path):
    key, fingerprint = "scale-and-shift/a", {"torch": "t", "machine": "m", "config": "c"}
    first = warm_up_in_a_new_process(tmp_path / "node-a", key, fingerprint)
    assert (first.fetched, first.refused, first.graphs_compiled) == (0, None, 1) and first.published > 0
    second = warm_up_in_a_new_process(tmp_path / "node-b", key, fingerprint)
    assert second.fetched == first.published and second.refused is None and second.published == 0
    assert (second.graphs_loaded, second.graphs_compiled) == (1, 0)


@pytest.mark.slow
def test_a_corrupt_bundle_in_the_cluster_is_refused_rebuilt_and_replaced(ray_cluster, tmp_path):
    key, fingerprint = "scale-and-shift/b", {"torch": "t", "machine": "m", "config": "c"}
    ray.get(compile_cache_store().put.remote(key, b"not a bundle", replace=False))
    rebuilt = warm_up_in_a_new_process(tmp_path / "node-a", key, fingerprint)
    assert rebuilt.refused.startswith("it is not a readable bundle") and rebuilt.graphs_compiled == 1
    assert rebuilt.published > 0  # the refused bundle is replaced: the next node loads
    after = warm_up_in_a_new_process(tmp_path / "node-b", key, fingerprint)
    assert after.refused is None and (after.graphs_loaded, after.graphs_compiled) == (1, 0)


def test_the_key_names_model_and_role_and_the_fingerprint_follows_every_option(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    key, fingerprint = compile_cache_key(EngineConfig(str(model), device="cpu"), "rank1")
    assert key == "tiny/rank1"
    elsewhere = compile_cache_key(EngineConfig(str(model), device="cpu", run_dir="elsewhere"), "rank1")[1]
    assert elsewhere == fingerprint  # where files go does not change what is built
    (model / "config.json").write_text('{"hidden_size": 16}')
    assert compile_cache_key(EngineConfig(str(model), device="cpu"), "rank1")[1]["config"] != fingerprint["config"]
