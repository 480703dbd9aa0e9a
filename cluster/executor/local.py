"""Where steps run: in this process (one worker) or on a Ray replica (a coordinator and N workers,
ray_executor.py). The engine sees the same three things from both: the model config, the KV block
count, execute(), and warm_up() before the first step. Ray is imported only when a replica needs it."""

from __future__ import annotations

from warpspec.config.engine import EngineConfig
from warpspec.workers.compiled_step import use_compile_cache
from warpspec.workers.runner import ModelRunner, StepOutput
from warpspec.workers.step import StepPlan


class LocalExecutor:
    def __init__(self, config: EngineConfig):
        use_compile_cache(config.run_dir)
        self.runner = ModelRunner(config.model, config.dtype, config.cache, config.device,
                                  cuda_graphs=config.cuda_graph_config(), quantization=config.quantization,
                                  moe_parallel=config.parallel.moe_parallel, deterministic=config.deterministic)
        self.model_config = self.runner.config
        self.num_blocks = self.runner.num_blocks

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.runner.execute(plan.build())

    def warm_up(self, aux_layer_ids: list[int]) -> None:
        self.runner.warm_up(aux_layer_ids)

    def shutdown(self) -> None:
        self.runner = None


def make_executor(config: EngineConfig):
    """A LocalExecutor, or a RayExecutor (ray_executor.py) when the config asks for Ray workers."""
    if not config.parallel.uses_ray:
        return LocalExecutor(config)
    from warpspec.executor.ray_executor import RayExecutor

    return RayExecutor(config)
