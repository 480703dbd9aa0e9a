"""One rank in this process: the executor of an engine core that runs in the front end's process. The
core sees the same things from it as from the coordinator's DriverExecutor over Ray workers (driver.py):
the model config, the KV block count, execute(), warm_up() before the first step, and the embedding table."""

from __future__ import annotations

import torch

from warpspec.config.engine import EngineConfig
from warpspec.workers.compile.compile_cache import open_compile_cache
from warpspec.workers.runner import ModelRunner
from warpspec.workers.step import StepOutput, StepPlan


class LocalExecutor:
    def __init__(self, config: EngineConfig):
        open_compile_cache(config.compile_cache, config.run_dir)
        self.runner = ModelRunner(config.model, config.dtype, config.cache, config.device,
                                  cuda_graphs=config.cuda_graph_config(), quantization=config.quantization,
                                  moe_parallel=config.parallel.moe_parallel, deterministic=config.deterministic)
        self.model_config = self.runner.config
        self.num_blocks = self.runner.num_blocks

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.runner.execute(plan.build())

    def embedding_table(self) -> torch.Tensor | None:
        return self.runner.embedding_table()

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        self.runner.warm_up(aux_layer_ids)

    def shutdown(self) -> None:
        self.runner = None
