"""Compiled steps built once per cluster: a replica on a node that never compiled fetches what the
first replica built, instead of compiling.

A node's compile cache folder is its own unless every replica mounts one (the `compile_cache`
option). So the cluster keeps the artifacts itself: one detached actor on the head node, the
CompileCacheStore, holds a bundle per (model, process role) (workers/compile/compile_cache.py packs and
checks them). Each process that compiles steps (the coordinator: rank 0 and the draft; each worker
actor: its rank) warms up inside `shared_compile_cache`:

    fetch the role's bundle -> unpack it into the local folder (checked; refused with the reason)
    warm up                 -> inductor loads every graph the folder holds, compiles the rest
    the first builder, or one whose fetched bundle was refused, publishes what it added

Every start-up leaves a CompileCacheEvent in the store: what it fetched or why not, how many graphs
it loaded and compiled, how long warming up took (`compile_cache_events`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from warpspec.config.engine import EngineConfig
from warpspec.workers.compile.compile_cache import build_fingerprint, list_files, pack, unpack
from warpspec.workers.compile.step_artifacts import graphs_built

logger = logging.getLogger(__name__)

STORE_NAME, STORE_NAMESPACE = "warpspec-compile-cache", "warpspec"
# Ray's resource of the head node: the store lives as long as the cluster, not as a worker node.
HEAD_NODE_RESOURCE = "node:__internal_head__"


@dataclass
class CompileCacheEvent:
    key: str  # "<model folder>/<role>"
    node_id: str
    fetched: int  # files written from the cluster's bundle (0: none was there, or it was refused)
    refused: str | None  # why the cluster's bundle was not used
    published: int  # files this start-up gave the cluster
    graphs_loaded: int  # inductor FX-graph cache hits while warming up
    graphs_compiled: int  # and misses
    warm_up_s: float


@ray.remote(num_cpus=0)
class CompileCacheStore:
    def __init__(self):
        self.bundles: dict[str, bytes] = {}
        self.events: list[CompileCacheEvent] = []

    def get(self, key: str) -> bytes | None:
        return self.bundles.get(key)

    def put(self, key: str, data: bytes, replace: bool) -> bool:
        """Keep data for key unless one is kept already (replace: the kept one was refused)."""
        if key in self.bundles and not replace:
            return False
        self.bundles[key] = data
        return True

    def record(self, event: CompileCacheEvent) -> None:
        self.events.append(event)

    def history(self) -> list[CompileCacheEvent]:
        return list(self.events)


def compile_cache_store():
    """The cluster's store, started on the head node by whoever asks first (outside the asker's
    placement group: a replica's gang captures the actors its processes start)."""
    return CompileCacheStore.options(name=STORE_NAME, namespace=STORE_NAMESPACE, get_if_exists=True,
                                     lifetime="detached", resources={HEAD_NODE_RESOURCE: 0.001},
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None)
                                     ).remote()


def compile_cache_events() -> list[CompileCacheEvent]:
    """What every start-up on this cluster did with the shared compile cache, oldest first."""
    return ray.get(compile_cache_store().history.remote())


def compile_cache_key(config: EngineConfig, role: str) -> tuple[str, dict[str, str]]:
    """(the store's key, the fingerprint a bundle must match) for one process role of a replica:
    "coordinator" (rank 0 and the draft) or "rank<r>". The fingerprint hashes the checkpoints'
    configs and every engine option, so a bundle built for other weights' shapes or other options
    is refused, not loaded (inductor would only miss on it)."""
    options = dataclasses.asdict(config)
    for path_option in ("run_dir", "compile_cache"):
        options.pop(path_option)
    model = Path(config.model)
    draft = config.speculative.draft
    options["model"] = _read_config(model)
    options["speculative"]["draft"] = _read_config(Path(draft)) if draft else None
    return f"{model.name}/{role}", build_fingerprint(role=role, **options)


def _read_config(folder: Path) -> str:
    path = folder / "config.json"
    return path.read_text() if path.is_file() else str(folder)


@contextlib.contextmanager
def shared_compile_cache(folder: Path, key: str, fingerprint: dict[str, str]):
    """Warm up inside this: before, the cluster's bundle for key is unpacked into folder; after, what
    the warm-up added is published when the cluster had none (or one this process refused). A store
    that cannot be reached costs the sharing, never the start-up: it is logged and the warm-up runs."""
    try:
        store = compile_cache_store()
        data = ray.get(store.get.remote(key))
    except RayError as error:
        logger.warning("compile cache %s: the cluster's store is unreachable (%s); compiling alone", key, error)
        store = None
    if store is None:
        yield
        return
    fetched, refused = 0, None
    if data is not None:
        before = len(list_files(folder))
        refused = unpack(folder, data, fingerprint)
        if refused is None:
            fetched = max(len(list_files(folder)) - before, 0)
            logger.info("compile cache %s: %d files fetched from the cluster", key, fetched)
        else:
            logger.warning("compile cache %s: the cluster's bundle is not used, %s; compiling", key, refused)
    before_files = list_files(folder)
    hits, misses = graphs_built()
    start = time.perf_counter()
    yield
    warm_up_s = time.perf_counter() - start
    new_hits, new_misses = graphs_built()
    published = 0
    try:
        if data is None or refused is not None:
            bundle = pack(folder, list_files(folder) - before_files, fingerprint)
            if bundle is not None and ray.get(store.put.remote(key, bundle.data, replace=refused is not None)):
                published = bundle.num_files
                logger.info("compile cache %s: %d files published to the cluster", key, published)
        ray.get(store.record.remote(CompileCacheEvent(key, ray.get_runtime_context().get_node_id(), fetched,
                                                      refused, published, new_hits - hits, new_misses - misses,
                                                      round(warm_up_s, 2))))
    except RayError as error:
        logger.warning("compile cache %s: publishing to the cluster's store failed (%s)", key, error)
