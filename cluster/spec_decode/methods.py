"""The drafters speculative.method names, each built into a proposer wherever the engine core runs
(the replica's process beside a one-rank target, or the coordinator actor beside rank 0). A new
drafter is its own module plus one line of PROPOSERS (and its name in config's SPECULATIVE_METHODS:
a test holds the two to the same names)."""

from __future__ import annotations

import logging

import torch

from warpspec.config.engine import EngineConfig
from warpspec.spec_decode.draft_runner import scratch_reserve
from warpspec.spec_decode.eagle3 import Eagle3Proposer
from warpspec.spec_decode.ngram import NgramProposer
from warpspec.spec_decode.proposer import Proposer
from warpspec.workers.compile.compile_cache import open_compile_cache
from warpspec.workers.loader import read_checkpoint_tensor, resolve_dtype
from warpspec.workers.model_config import ModelConfig
from warpspec.workers.models.eagle3_draft import load_eagle3

logger = logging.getLogger(__name__)


def load_proposer(config: EngineConfig, model_config: ModelConfig, num_blocks: int,
                  embed_tokens: torch.Tensor | None = None) -> Proposer:
    """The proposer config.speculative.method names, for a target of model_config whose KV cache holds
    num_blocks blocks. embed_tokens: the target's embedding table when it is in this process (a draft
    model may share it; else it reads it from the checkpoint)."""
    return PROPOSERS[config.speculative.method](config, model_config, num_blocks, embed_tokens)


def load_eagle3_proposer(config: EngineConfig, model_config: ModelConfig, num_blocks: int,
                         embed_tokens: torch.Tensor | None = None) -> Eagle3Proposer:
    """The draft with its own KV cache of num_blocks blocks (indexed by the target's block tables).
    It embeds with the target's table: pass it when the target is in this process, else it is read
    from the checkpoint."""
    spec = config.speculative
    dtype = resolve_dtype(config.dtype, model_config)
    if embed_tokens is None:
        embed_tokens = read_checkpoint_tensor(config.model, "model.embed_tokens.weight", model_config).to(dtype)
    draft = load_eagle3(spec.draft, model_config, embed_tokens, dtype, spec.aux_layer_offset)
    compile_draft = spec.compile_draft and not config.enforce_eager  # enforce_eager: every step eager
    if compile_draft:
        open_compile_cache(config.compile_cache, config.run_dir)
    return Eagle3Proposer(draft, num_blocks, config.cache.block_size, draft_device(config.device),
                          compile=compile_draft, deterministic=config.deterministic,
                          num_speculative_tokens=spec.num_speculative_tokens, cuda_graphs=config.cuda_graph_config(),
                          scratch_blocks=scratch_reserve(config.scheduler.max_num_seqs, spec.num_speculative_tokens,
                                                         config.cache.block_size))


def load_ngram_proposer(config: EngineConfig, model_config: ModelConfig, num_blocks: int,
                        embed_tokens: torch.Tensor | None = None) -> NgramProposer:
    return NgramProposer(config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max)


def draft_device(target_device: str) -> torch.device:
    """The draft runs on the target's device when this process can see it: in the engine's process
    beside a one-rank target, or in a coordinator that Ray gave a GPU. A coordinator without one
    runs the draft on its CPU (correct, and slow for a large draft), and says so."""
    device = torch.device(target_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        logger.warning("the EAGLE-3 draft runs on the CPU: this process sees no GPU (target on %s)", target_device)
        return torch.device("cpu")
    return device


PROPOSERS = {
    "eagle3": load_eagle3_proposer,
    "ngram": load_ngram_proposer,
}
