"""EngineStats: what the engine tells the outside about its load, in one snapshot. The serving layer
builds its replica stats, gauges and admin answers from it, never from the engine's scheduler or
block manager, so the engine may live in another process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_kv_blocks: int
    num_free_kv_blocks: int  # includes blocks held only by the prefix cache (free to evict)
    num_running: int
    num_waiting: int  # in the scheduler's queue
    prefix_cache_hit_rate: float  # over all prompt tokens admitted so far
    acceptance_length: float  # engine-wide mean; 0 without speculation
    constrained_acceptance_length: float = 0.0  # the same over requests with a structured output
    # Drafts proposed and accepted at each draft position (index 0: the first draft), in all so far:
    # where along the draft acceptance falls off.
    drafted_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()
    draft_share: float = 0.0  # of the engine's step time, the proposer's
    # Under speculative_policy adaptive, the step cost model (spec_decode/cost_model.py): (step,
    # sequences, length, milliseconds) per entry, step "target" (length: tokens per sequence), "mixed"
    # (the longest), "draft" (drafts per request) or "host" (the rest of a step, length as for target).
    step_costs: tuple[tuple[str, int, int, float], ...] = ()
    # The engine-wide chance that draft j + 1 is accepted (spec_decode/draft_length.py), and the
    # draft length the last step chose for its batch (None: fixed, or not chosen by rate yet).
    acceptance_rates: tuple[float, ...] = ()
    draft_length: int | None = None
    # A hybrid KV cache (workers/kv_groups.py): blocks held per KV group, full attention first, by
    # name ("full attention", "chunked attention (8192)", ...); empty with one group.
    kv_blocks_by_group: tuple[tuple[str, int], ...] = ()
    num_released_kv_blocks: int = 0  # chunked groups' blocks given back as sequences crossed chunks
