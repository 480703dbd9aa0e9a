"""What an engine runs before its first request, besides building its compiled graphs: a stand-in
prompt through the target (and the draft), and how many graphs a warm-up loaded or compiled. Apart
from startup.py, which the command line imports before torch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from warpspec.sample.keyed_random import KeyedRandom
from warpspec.spec_decode.proposer import DraftRequest, Proposer
from warpspec.workers.compile.step_artifacts import graphs_built
from warpspec.workers.kv_groups import KVGroupLayout
from warpspec.workers.step import SequenceStep, StepPlan

# The stand-in prompt's length at most: 8 tokens left the first request as slow as without it, 64
# and more did not.
WARM_UP_PROMPT_TOKENS = 256
STAND_IN_PROMPT_ID = "warm-up-prompt"


def run_stand_in_prompt(executor, kv_layout: KVGroupLayout, block_size: int, num_tokens: int, vocab_size: int,
                        aux_layer_ids: list[int], draft: tuple[Proposer, int] | None) -> str:
    """One stand-in prompt of num_tokens random tokens through the executor's target, and with draft
    (a proposer that takes stand-ins, as for the step timing, and its most drafts) the draft's first
    proposal after it. A process's first prefills pay for the memory their activations take the
    first time (page faults) and for first calls into the GEMM library: the bundled pair's first
    33-token request took 28-38 ms in-process against 15-25 for the next ones, 23-33 ms after a
    stand-in of 256 tokens. It runs in the first blocks, which no request holds yet; the caller has
    the executor drop STAND_IN_PROMPT_ID from its batch with the next step. Returns what ran."""
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(vocab_size, (num_tokens + 1,), generator=generator).tolist()
    table = list(range(-(-num_tokens // block_size)))
    windows = [table] * kv_layout.num_window_groups  # a hybrid cache's chunked groups
    plan = StepPlan([SequenceStep(token_ids[:-1], 0, table, num_tokens - 1, STAND_IN_PROMPT_ID, windows)],
                    block_size, aux_layer_ids, chunk_size=kv_layout.chunk_size)
    output = executor.execute(plan)
    if draft is not None:  # its features at p with the token at p + 1, the last one as if sampled
        proposer, max_drafts = draft
        request = DraftRequest(STAND_IN_PROMPT_ID, token_ids[1:], 0, 0, max_drafts, table, 0.0, KeyedRandom(0),
                               context=token_ids)
        proposer.propose([request], output.aux_hidden)
        proposer.release([STAND_IN_PROMPT_ID])
    return f"{num_tokens} tokens"


def graphs_built_by(warm_up: Callable[[], None], whose: str) -> str:
    """Run warm_up; say how many graphs this process loaded from the compile cache and compiled."""
    hits, misses = graphs_built()
    warm_up()
    new_hits, new_misses = graphs_built()
    return f"{whose}: {new_hits - hits} graphs loaded from the compile cache, {new_misses - misses} compiled"
