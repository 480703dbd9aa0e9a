"""CUDA graphs for the EAGLE-3 draft's greedy proposal on a GPU: the padded catch-up, the k - 1
single-token steps and the argmax between them, replayed as one graph.

The draft is one decoder layer, so on a GPU each of its steps is a few dozen small kernels, and
launching them one by one from Python costs more than running them. As for the target's graphs
(workers/compile/cuda_graphs.py), a graph fixes every shape. The requests are padded up to the next
captured batch size, and their block tables are widened to the most blocks a captured step allows;
a proposal that does not fit (more requests than the largest size, or a longer table) runs as
before. Each padding request's catch-up positions (0..k) and draft steps (k + 1..2k - 1) write into
one pad block that no request owns (the proposer reserves it after the step's scratch blocks), and
its drafts are dropped.

A graph holds the address of the draft's KV cache. The cache grows while the largest batch of drafts
does (Eagle3Proposer._with_scratch); the graphs are then dropped and captured again at their next
use, so captures stop once the largest batch has been seen.

The capture itself runs only on a CUDA device; the padding, and that padding leaves every real
request's drafts as they were, are tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from warpspec.workers.compile.cuda_graphs import capture

# The arguments of Eagle3Proposer._greedy_proposal_forward, in order: input_ids, features, positions,
# query_start_loc, seq_lens, block_tables, slot_mapping, last_rows.
ProposalInputs = tuple[torch.Tensor, ...]
BLOCK_TABLES = 5


def pad_greedy_proposal(inputs: ProposalInputs, batch_size: int, pad_block: int, max_blocks: int,
                        block_size: int) -> ProposalInputs:
    """inputs of n requests, each catch_up_len positions, padded to batch_size requests with block
    tables max_blocks wide. A padding request runs positions 0..catch_up_len - 1 on token 0 and zero
    features, its whole table the pad block.

    2 requests of 4 positions padded to 3: last_rows [3, 7] -> [3, 7, 11], block table rows
    [[5, 6], [9, 0]] -> [[5, 6, 0, ...], [9, 0, 0, ...], [pad, pad, pad, ...]]."""
    input_ids, features, positions, query_start_loc, seq_lens, block_tables, slot_mapping, last_rows = inputs
    num_requests = last_rows.shape[0]
    catch_up_len = input_ids.shape[0] // num_requests
    num_pad = batch_size - num_requests
    if num_pad < 0 or block_tables.shape[1] > max_blocks:
        raise ValueError(f"a proposal for {num_requests} requests over {block_tables.shape[1]} blocks does not fit "
                         f"a graph of {batch_size} requests over {max_blocks}")
    device = input_ids.device
    pad_positions = torch.arange(catch_up_len, device=device).repeat(num_pad)
    tables = torch.full((batch_size, max_blocks), pad_block, dtype=block_tables.dtype, device=device)
    tables[:num_requests] = 0
    tables[:num_requests, : block_tables.shape[1]] = block_tables
    return (
        torch.cat([input_ids, input_ids.new_zeros(num_pad * catch_up_len)]),
        torch.cat([features, features.new_zeros(num_pad * catch_up_len, features.shape[1])]),
        torch.cat([positions, pad_positions]),
        torch.arange(batch_size + 1, dtype=query_start_loc.dtype, device=device) * catch_up_len,
        torch.cat([seq_lens, seq_lens.new_full((num_pad,), catch_up_len)]),
        tables,
        torch.cat([slot_mapping, pad_block * block_size + pad_positions.to(slot_mapping.dtype)]),
        torch.cat([last_rows, torch.arange(num_requests, batch_size, device=device) * catch_up_len + catch_up_len - 1]),
    )


class CapturedProposal:
    """One graph of the proposal with the input tensors it reads and the drafts it writes."""

    def __init__(self, proposal: Callable[..., torch.Tensor], inputs: ProposalInputs, pool):
        self.inputs = tuple(t.clone() for t in inputs)
        self.graph, self.drafts = capture(lambda: proposal(*self.inputs), pool)

    def replay(self, inputs: ProposalInputs) -> torch.Tensor:
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.drafts


class DraftGraphRunner:
    """Runs greedy proposals through captured graphs; `run` returns None for any it cannot take."""

    def __init__(self, proposal: Callable[..., torch.Tensor], batch_sizes: tuple[int, ...], max_blocks: int,
                 block_size: int):
        """proposal: Eagle3Proposer._greedy_proposal_forward; batch_sizes and max_blocks: the captured
        shapes (the target's CUDA-graph batch sizes, and its max_model_len in blocks)."""
        self.proposal = proposal
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.graphs: dict[int, CapturedProposal] = {}
        self.pool = None
        self.cache_address: int | None = None
        self.num_replays = 0

    def graph_batch_size(self, num_requests: int, num_blocks: int) -> int | None:
        """The captured batch size a proposal of num_requests over num_blocks-wide tables runs at."""
        if num_blocks > self.max_blocks:
            return None
        return next((size for size in self.batch_sizes if size >= num_requests), None)

    def run(self, inputs: ProposalInputs, pad_block: int, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """The drafts [num_requests, k] of inputs (on the GPU), or None to run the proposal as before."""
        num_requests = inputs[-1].shape[0]
        batch_size = self.graph_batch_size(num_requests, inputs[BLOCK_TABLES].shape[1])
        if batch_size is None:
            return None
        if kv_cache.data_ptr() != self.cache_address:  # the cache grew: every graph holds the old one
            # And a new pool: the graphs just dropped were the old one's only users, and capturing into
            # a pool they released fails the caching allocator's assert (use_count > 0; torch 2.11 on
            # an H200), after which every proposal ran without graphs.
            self.graphs.clear()
            self.pool = None
            self.cache_address = kv_cache.data_ptr()
        padded = pad_greedy_proposal(inputs, batch_size, pad_block, self.max_blocks, self.block_size)
        if batch_size not in self.graphs:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            self.graphs[batch_size] = CapturedProposal(self.proposal, padded, self.pool)
        drafts = self.graphs[batch_size].replay(padded)
        self.num_replays += 1
        return drafts[:num_requests].clone()  # the next replay overwrites the graph's output
