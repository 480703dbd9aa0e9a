"""How a front end (LLM, AsyncLLM) reaches its engine core. In this process the core is its own
client: an EngineCore over a LocalExecutor. With Ray workers the core runs in the replica's
coordinator actor (coordinator.py), and a RayCoreClient (ray_client.py) offers the same surface
through a CoordinatorHandle (coordinator_handle.py). Ray is imported only for that one."""

from __future__ import annotations

from warpspec.config.engine import EngineConfig
from warpspec.core.engine_core import EngineCore
from warpspec.core.requests import check_kv_capacity
from warpspec.core.startup import StartupTimer
from warpspec.executor.local import LocalExecutor
from warpspec.spec_decode.proposer import Proposer
from warpspec.workers.models.registry import load_model_config


def make_core_client(config: EngineConfig, proposer: Proposer | None = None):
    """An EngineCore in this process, or, with Ray workers, a RayCoreClient for the core inside the
    replica's coordinator actor."""
    if not config.parallel.uses_ray:
        check_kv_capacity(config, load_model_config(config.model))  # before any weight loads
        startup = StartupTimer()
        with startup.phase("weights and KV cache") as phase:
            executor = LocalExecutor(config)
            phase.detail = f"1 rank, {executor.num_blocks} KV blocks"
        return EngineCore(config, executor, proposer, startup)
    if proposer is not None:
        raise ValueError("a proposer object runs in this process only: with Ray workers (num_workers > 1 or "
                         "executor='ray') the engine core and its draft run in the coordinator; pass draft=")
    from warpspec.client.ray_client import RayCoreClient  # imports Ray: only a replica on Ray needs it

    return RayCoreClient(config)
