"""Steps for a runner built by hand, on the runner's KV layout (workers/kv_groups.py)."""

from __future__ import annotations

from warpspec.workers.step import SequenceStep, StepInput


def build_step(runner, seqs: list[SequenceStep], aux_layer_ids: list[int] | None = None) -> StepInput:
    """StepInput.build for runner's KV cache. With a hybrid cache each chunked group gets blocks of
    its own, as the engine would give them: group g's table is the full group's shifted by g times
    the cache's num_blocks (CacheConfig's: the runner holds that many blocks per group)."""
    layout = runner.kv_layout
    if layout.is_hybrid:
        stride = runner.num_blocks // len(layout.groups)
        used = max(block for seq in seqs for block in seq.block_table)
        assert used < stride, f"block {used} of the full group reaches the next group's ({stride} blocks each)"
        seqs = [SequenceStep(seq.token_ids, seq.num_cached, seq.block_table, seq.logits_from, seq.request_id,
                             [[block + group * stride for block in seq.block_table]
                              for group in range(1, len(layout.groups))]) for seq in seqs]
    return StepInput.build(seqs, runner.cache_config.block_size, aux_layer_ids, layout.chunk_size)
