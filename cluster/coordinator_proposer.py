"""EAGLE-3 inside the replica's coordinator actor, where rank 0's hidden states arrive.

With Ray workers, each step's captured hidden states (3 x hidden floats per token) stop at the
coordinator: it keeps them for the draft and passes only the logits on to the engine. After verifying,
the engine sends one small message per step (which positions each sequence kept, their tokens and
block tables, how many drafts it wants) and gets the drafts back:

    engine                      coordinator                       workers
    execute(step) ----------->  graph.execute ------------------> target forward (k + 1 positions)
                  <-----------  logits   (keeps aux hidden states)
    verify, append
    propose(kept) ----------->  draft catch-up + k - 1 steps
                  <-----------  draft tokens (+ probs when sampled)

Draft sampling there uses per-request generators seeded from the request's seed, so a seeded request
still gets the same text whatever else is in its batch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgpack
import torch

from warpspec.config import EngineConfig
from warpspec.eagle3_proposer import Eagle3Proposer
from warpspec.proposer import DraftRequest, Drafts
from warpspec.workers import wire
from warpspec.workers.eagle3 import load_eagle3
from warpspec.workers.loader import read_checkpoint_tensor, resolve_dtype
from warpspec.workers.model_config import ModelConfig

logger = logging.getLogger(__name__)


def encode_requests(requests: list[DraftRequest], release: list[str]) -> bytes:
    rows = [[r.request_id, r.token_ids, r.first_position, r.feature_start, r.num_drafts, r.block_table,
             r.temperature, r.seed] for r in requests]
    return msgpack.packb({"requests": rows, "release": release}, use_bin_type=True)


def decode_requests(data: bytes) -> tuple[list[DraftRequest], list[str]]:
    message = msgpack.unpackb(data, raw=False)
    return [DraftRequest(*row) for row in message["requests"]], message["release"]


def encode_drafts(drafts: list[Drafts]) -> bytes:
    return msgpack.packb([[d.token_ids, None if d.probs is None else wire.pack_tensor(d.probs)] for d in drafts],
                         use_bin_type=True)


def decode_drafts(data: bytes) -> list[Drafts]:
    return [Drafts(ids, None if probs is None else wire.unpack_tensor(probs))
            for ids, probs in msgpack.unpackb(data, raw=False)]


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
    if spec.compile_draft:
        # Compiled kernels are cached here, so a restart does not pay the compile again.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(config.run_dir, "inductor").resolve()))
    return Eagle3Proposer(draft, num_blocks, config.cache.block_size, draft_device(config.device),
                          compile=spec.compile_draft)


def draft_device(target_device: str) -> torch.device:
    """The draft runs on the target's device when this process can see it: in the engine's process
    beside a one-rank target, or in a coordinator that Ray gave a GPU. A coordinator without one
    runs the draft on its CPU (correct, and slow for a large draft), and says so."""
    device = torch.device(target_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        logger.warning("the EAGLE-3 draft runs on the CPU: this process sees no GPU (target on %s)", target_device)
        return torch.device("cpu")
    return device


class DraftServer:
    """Coordinator side: the proposer, and the hidden states of the last step."""

    def __init__(self, proposer: Eagle3Proposer):
        self.proposer = proposer
        self.aux_hidden: list[torch.Tensor] = []

    def keep(self, aux_hidden: list[torch.Tensor]) -> None:
        self.aux_hidden = aux_hidden

    def handle(self, data: bytes) -> bytes:
        requests, release = decode_requests(data)
        self.proposer.release(release)
        drafts = self.proposer.propose(requests, self.aux_hidden) if requests else []
        self.aux_hidden = []  # each step's hidden states serve exactly one proposal
        return encode_drafts(drafts)


class CoordinatorProposer:
    """Engine side: the Proposer whose draft runs in the coordinator."""

    def __init__(self, executor, aux_layer_ids: tuple[int, ...]):
        self.executor = executor  # a RayExecutor
        self.aux_layer_ids = aux_layer_ids
        self.pending_release: list[str] = []

    def propose(self, requests: list[DraftRequest], aux_hidden: list[torch.Tensor]) -> list[Drafts]:
        release, self.pending_release = self.pending_release, []
        return decode_drafts(self.executor.propose(encode_requests(requests, release)))

    def release(self, request_ids: list[str]) -> None:
        self.pending_release.extend(request_ids)  # sent with the next proposal, no call of its own
