"""Engine configuration: one dataclass per concern, gathered under EngineConfig. The options users
set by name, and the front ends that take them, are defined in options.py."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from warpspec.workers.kv_cache import CacheConfig
from warpspec.workers.quantization import check_quantization


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences running together
    # Tokens per step over all sequences: decodes first, the rest goes to prefill chunks.
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Requests queued but not yet running, beyond which new submissions are refused (AsyncLLM).
    max_waiting_requests: int = 1024
    # Aging of request priorities: a request is served before every request of a priority one better
    # (one lower) that arrives this many engine steps after it (core/scheduler.py).
    priority_aging_steps: int = 1000

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "priority_aging_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def graph_batch_sizes(sizes: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes worth a graph when at most max_num_seqs sequences run together: the smaller
    ones and the first that holds max_num_seqs (a batch pads up to it); none past it, which no step
    would use. (1, 2, 4, 8) at 3 -> (1, 2, 4); at 1 -> (1,), and a CPU replica builds no graph for
    several sequences."""
    sizes = sorted(set(sizes))
    holding = [b for b in sizes if b >= max_num_seqs]
    return tuple(b for b in sizes if b < max_num_seqs) + tuple(holding[:1])


EXECUTORS = ("auto", "local", "ray")
DISPATCH_MODES = ("compiled", "actor")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
COMM_BACKENDS = ("auto", "gloo", "shm", "nccl")
MOE_PARALLEL_MODES = ("tensor", "expert")
SPECULATIVE_POLICIES = ("adaptive", "fixed")
# The drafters speculative.method may name: eagle3 (a draft model, its folder named by draft) and
# ngram (prompt lookup, no model). spec_decode/methods.py loads each; a test holds the two to the same names.
SPECULATIVE_METHODS = ("eagle3", "ngram")
MAX_SPECULATIVE_TOKENS = 16  # drafts one verification step may hold


@dataclass
class ParallelConfig:
    num_workers: int = 1  # ranks the model is sharded over, one GPU (or one process on CPU) each
    # "local" runs one rank in this process; "ray" puts a coordinator and num_workers worker actors on
    # a Ray cluster; "auto" is local for one worker and ray otherwise.
    executor: str = "auto"
    # Per-step dispatch from the coordinator to the workers: a Ray Compiled Graph, or plain actor calls.
    dispatch: str = "compiled"
    placement_strategy: str = "STRICT_PACK"
    placement_timeout_s: float = 60.0
    comm_backend: str = "auto"  # nccl on GPU; on CPU shm when the ranks share a host, else gloo
    # Through Ray the engine core streams its replies to the replica, and Ray spends ~0.3 ms of the
    # core's time on each (measured: one worker, bundled target, a 2.1 ms step). Between a request's
    # first tokens and its end the core sends at most one reply per this many ms, merging the steps
    # in between; 0 sends one a step. First tokens, ends, failures and the effect of an abort are sent
    # at once.
    core_reply_interval_ms: float = 10.0
    # Routed experts: "tensor" splits every expert's intermediate width over all ranks (each rank reads
    # 1/N of every chosen expert: the least time per step at small batches); "expert" gives each rank
    # whole experts (no rank reads a chosen expert's slices, but the rank that owns it reads all of it).
    moe_parallel: str = "tensor"

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {self.num_workers!r}")
        for name, value, allowed in (("executor", self.executor, EXECUTORS),
                                     ("dispatch", self.dispatch, DISPATCH_MODES),
                                     ("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES),
                                     ("comm_backend", self.comm_backend, COMM_BACKENDS),
                                     ("moe_parallel", self.moe_parallel, MOE_PARALLEL_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.executor == "local" and self.num_workers > 1:
            raise ValueError(f"executor='local' runs one worker; num_workers={self.num_workers} needs executor='ray'")
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s must be positive, got {self.placement_timeout_s}")
        if not self.core_reply_interval_ms >= 0:
            raise ValueError(f"core_reply_interval_ms must be 0 or more, got {self.core_reply_interval_ms}")

    @property
    def uses_ray(self) -> bool:
        return self.executor == "ray" or (self.executor == "auto" and self.num_workers > 1)


@dataclass
class SpeculativeConfig:
    # The drafter (SPECULATIVE_METHODS); None: eagle3 when a draft folder is given, else no speculation.
    method: str | None = None
    draft: str | None = None  # an EAGLE-3 checkpoint folder (method eagle3)
    num_speculative_tokens: int = 3  # k draft tokens verified per target step
    # 0 when the checkpoint's eagle_aux_hidden_state_layer_ids follow vLLM (id i = the stream entering
    # layer i), 1 for checkpoints configured in SGLang's convention (one lower for the same layers).
    aux_layer_offset: int = 0
    compile_draft: bool = True  # torch.compile the draft (eager, with a warning, if that fails)
    # Sampled requests: False verifies by rejection sampling (the most accepted drafts any lossless
    # scheme gets); True by Gumbel-max coupling, under which a seeded request's tokens equal its
    # tokens without a draft, at a lower acceptance (sample/rejection_sampler.py).
    coupled_verification: bool = False
    # adaptive: each step's draft length chosen from measured step costs and acceptance
    # (spec_decode/draft_length.py), so that the draft never makes a step slower than plain decoding
    # would be; fixed: num_speculative_tokens at every step.
    speculative_policy: str = "adaptive"
    # ngram: the longest suffix of the text so far (at most prompt_lookup_max tokens, at least
    # prompt_lookup_min) that occurred before proposes what followed it (spec_decode/ngram.py).
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if self.method is None and self.draft is not None:
            self.method = "eagle3"
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)} (or unset: no "
                             f"speculation without a draft), got {self.method!r}")
        if self.method == "eagle3" and self.draft is None:
            raise ValueError("speculative_method 'eagle3' needs draft, the EAGLE-3 checkpoint folder")
        if self.method != "eagle3" and self.draft is not None:
            raise ValueError(f"draft is read by speculative_method 'eagle3' only, not {self.method!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        if low > high:
            raise ValueError(f"prompt_lookup_min must be at most prompt_lookup_max ({high}), got {low}")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be one of {', '.join(SPECULATIVE_POLICIES)}, "
                             f"got {self.speculative_policy!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.aux_layer_offset not in (0, 1):
            raise ValueError(f"aux_layer_offset must be 0 (vLLM ids) or 1 (SGLang ids), got {self.aux_layer_offset!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def describe(self) -> str | None:
        """The drafter, as logs, metrics and model cards name it: "eagle3 (<folder>)", "ngram (n 2-5)"."""
        if self.method == "eagle3":
            return f"eagle3 ({self.draft})"
        if self.method == "ngram":
            return f"ngram (n {self.prompt_lookup_min}-{self.prompt_lookup_max})"
        return self.method


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # "auto" (the checkpoint's), "float32", "bfloat16", "float16"
    # None: the checkpoint's max_position_embeddings. Prompt + output never exceed it.
    max_model_len: int | None = None
    device: str = "auto"  # "auto": cuda when this process sees a GPU, else cpu (resolved on construction)
    # None: the checkpoint's precision (FP8 for an fbgemm_fp8 checkpoint); "fp8": quantize a bf16/fp32
    # checkpoint's linear and expert weights to FP8 as they load (workers/quantization.py).
    quantization: str | None = None
    seed: int = 0  # seeds requests that bring no seed of their own
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    run_dir: str = "runs"  # where a locally started Ray keeps its session files
    # Compiled steps' artifacts (workers/compile/compile_cache.py): None keeps them under run_dir/inductor
    # (or where TORCHINDUCTOR_CACHE_DIR says); a folder every replica mounts shares them.
    compile_cache: str | None = None
    # Decode and verification steps replay captured CUDA graphs on CUDA devices and run
    # torch.compile'd on a one-rank CPU replica (workers/compile/compiled_step.py); True runs every step
    # eagerly (debugging, profiling single kernels). WARPSPEC_ENFORCE_EAGER=1 in the environment makes
    # True the default, for programs that build many short-lived engines (the test suite), where each
    # engine's compile costs more than it saves.
    enforce_eager: bool = field(default_factory=lambda: os.environ.get("WARPSPEC_ENFORCE_EAGER") == "1")
    # Every row computed to the same bits whatever else the step holds (kernels/batch_invariant.py):
    # greedy output in bf16 then depends neither on the other requests nor on speculation.
    deterministic: bool = False
    # Batch sizes whose decode and verification steps are captured as CUDA graphs; larger ones run eagerly.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

    def cuda_graph_config(self):
        from warpspec.workers.compile.cuda_graphs import CudaGraphConfig

        if self.enforce_eager:
            return None
        k = self.speculative.num_speculative_tokens
        return CudaGraphConfig(batch_sizes=graph_batch_sizes(self.cuda_graph_batch_sizes, self.scheduler.max_num_seqs),
                               query_lens=(1, k + 1) if self.speculative.enabled else (1,),
                               max_model_len=self.max_model_len or CudaGraphConfig.max_model_len)

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        sizes = self.cuda_graph_batch_sizes
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be positive integers, got {sizes!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        k = self.speculative.num_speculative_tokens
        if self.speculative.enabled and self.scheduler.max_num_batched_tokens < k + 1:
            # A verification runs the last token and all k drafts in one step, or waits.
            raise ValueError(f"max_num_batched_tokens must be at least num_speculative_tokens + 1 = {k + 1} "
                             f"when speculating, got {self.scheduler.max_num_batched_tokens}")
        check_quantization(self.quantization)
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
