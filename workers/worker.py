"""One rank of a model replica: joins the collective group, loads its shard, runs steps.

A plain class, so tests can build it in-process. Ranks 1..N-1 run in an actor shell that only forwards
calls (cluster/executor/actors.py); rank 0 runs inside the coordinator, in its DriverExecutor
(cluster/executor/driver.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from warpspec.workers.compile.compile_cache import open_compile_cache
from warpspec.workers.compile.cuda_graphs import CudaGraphConfig
from warpspec.workers.distributed.comm import CommInit
from warpspec.workers.distributed.communicators import make_communicator
from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.persistent_batch import BatchUpdate, PersistentBatch
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import StepInput, StepOutput


@dataclass
class WorkerConfig:
    model: str
    dtype: str
    cache: CacheConfig
    comm: CommInit
    device: str = "cpu"
    num_threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    cuda_graphs: CudaGraphConfig | None = None  # used on CUDA devices only
    quantization: str | None = None  # None or "fp8" (see workers/quantization.py)
    moe_parallel: str = "tensor"  # routed experts split by width ("tensor") or whole ("expert")
    deterministic: bool = False  # batch-invariant steps (kernels/batch_invariant.py)
    run_dir: str = "runs"  # compiled steps' cache lives under it, unless compile_cache names a folder
    compile_cache: str | None = None


@dataclass
class WorkerInfo:
    rank: int
    pid: int
    num_blocks: int
    bytes_read: int
    param_bytes: int
    comm_backend: str  # the collectives this rank joined: local, gloo, shm or nccl


class ShardWorker:
    def __init__(self, config: WorkerConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.compile_cache = open_compile_cache(config.compile_cache, config.run_dir)
        self.comm = make_communicator(config.comm)
        self.runner = ModelRunner(config.model, config.dtype, config.cache, config.device, self.comm,
                                  cuda_graphs=config.cuda_graphs, quantization=config.quantization,
                                  moe_parallel=config.moe_parallel, deterministic=config.deterministic)
        self.batch = PersistentBatch()

    def info(self) -> WorkerInfo:
        report = self.runner.model.load_report
        return WorkerInfo(self.comm.rank, os.getpid(), self.runner.num_blocks, report.bytes_read,
                          report.param_bytes, self.config.comm.backend)

    def execute(self, step_bytes: bytes) -> tuple[float, bytes]:
        """Encoded BatchUpdate -> (compute seconds, encoded StepOutput). The update brings this rank's
        persistent batch to the step (persistent_batch.py). The time travels beside the payload so
        the coordinator need not decode it to read the time."""
        with self.comm.failing_together():
            output = self.runner.execute(self.batch.apply(BatchUpdate.from_bytes(step_bytes)))
        return output.compute_s, output.to_bytes()

    def execute_step(self, step: StepInput) -> StepOutput:
        """Rank 0's part of a step, run in the coordinator (which plans the batch: no update)."""
        with self.comm.failing_together():
            return self.runner.execute(step)

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        """ModelRunner.warm_up, at the same time as every other rank."""
        with self.comm.failing_together():
            self.runner.warm_up(aux_layer_ids)

    def num_collectives(self) -> int:
        return self.comm.num_collectives

    def close(self) -> None:
        self.comm.close()


def address_and_free_port() -> tuple[str, int]:
    """This host's address and a TCP port free on it now, for rank 0 to host the gloo rendezvous."""
    address = socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return address, s.getsockname()[1]
