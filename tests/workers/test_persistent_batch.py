"""Ranks 1..N-1 rebuild every step from deltas: through admissions, growing tables, preemption (a new
table), departures and resets, the StepInput a rank builds equals the one built from the whole plan."""

from __future__ import annotations

import pytest
import torch

from warpspec.workers.persistent_batch import BatchMirror, BatchUpdate, PersistentBatch
from warpspec.workers.step import SequenceStep, StepInput, StepPlan

BLOCK = 4


def assert_same_step(got: StepInput, want: StepInput) -> None:
    for name, value in vars(want).items():
        other = getattr(got, name)
        assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value, name


def send(mirror: BatchMirror, batch: PersistentBatch, plan: StepPlan) -> int:
    """One step through the wire; returns the message's size."""
    data = mirror.update(plan.seqs, plan.block_size, plan.aux_layer_ids, plan.left_request_ids).to_bytes()
    assert_same_step(batch.apply(BatchUpdate.from_bytes(data)), plan.build())
    return len(data)


def test_deltas_rebuild_every_step():
    mirror, batch = BatchMirror(), PersistentBatch()
    tables = {"a": [3, 4], "b": [7]}
    # Step 1: two prefills.
    send(mirror, batch, StepPlan([SequenceStep([1, 5, 6, 7, 8], 0, tables["a"], 4, "a"),
                                  SequenceStep([1, 9], 0, tables["b"], 1, "b")], BLOCK, [1, 2]))
    # Step 2: decodes; a's table grows in place, b's does not.
    tables["a"].append(11)
    send(mirror, batch, StepPlan([SequenceStep([20], 5, tables["a"], 0, "a"),
                                  SequenceStep([21], 2, tables["b"], 0, "b")], BLOCK))
    # Step 3: b preempted (not scheduled); c arrives and reuses a's first block (prefix hit).
    tables["c"] = [3, 12]
    send(mirror, batch, StepPlan([SequenceStep([22, 23, 24], 6, tables["a"], 0, "a"),
                                  SequenceStep([30, 31], 4, tables["c"], 1, "c")], BLOCK))
    # Step 4: b back after preemption, recomputed in a new table; a left (finished).
    tables["b"] = [5, 6]
    update = mirror.update([SequenceStep([1, 9, 21, 40], 0, tables["b"], 3, "b")], BLOCK, [], ["a"])
    assert update.forget == [0] and update.tables == [[1, 0, [5, 6]]]  # b's new table, whole
    assert_same_step(batch.apply(BatchUpdate.from_bytes(update.to_bytes())),
                     StepPlan([SequenceStep([1, 9, 21, 40], 0, tables["b"], 3, "b")], BLOCK).build())
    assert 0 not in batch.tables
    # Step 5: d takes a's freed slot.
    tables["d"] = [8]
    update = mirror.update([SequenceStep([2], 0, tables["d"], 0, "d")], BLOCK, [], [])
    assert update.seqs[0][0] == 0
    batch.apply(BatchUpdate.from_bytes(update.to_bytes()))
    # After a failed step the mirror resets: everything scheduled goes whole, stale slots are dropped.
    mirror.needs_reset = True
    send(mirror, batch, StepPlan([SequenceStep([41], 4, tables["b"], 0, "b")], BLOCK))
    assert set(batch.tables) == {0}


def test_a_decode_step_costs_bytes_per_sequence_not_per_block():
    """8 sequences 4,096 tokens deep (256 blocks each): the first step sends the tables, later decode
    steps only slots and tokens, where the whole StepInput carries every table every step."""
    mirror, batch = BatchMirror(), PersistentBatch()
    tables = [list(range(i * 257, i * 257 + 256)) for i in range(8)]
    plan = StepPlan([SequenceStep([7], 1023 * BLOCK, t, 0, f"r{i}") for i, t in enumerate(tables)], 16)
    first = send(mirror, batch, plan)
    later = send(mirror, batch, plan)
    assert later < 200 < first
    assert len(plan.build().to_bytes()) > 40 * later


def test_out_of_step_messages_and_other_versions_are_refused():
    batch = PersistentBatch()
    with pytest.raises(ValueError, match="slot 3 holds no table, the message appends from block 2"):
        batch.apply(BatchUpdate(BLOCK, seqs=[[3, 8, [1], 0]], tables=[[3, 2, [9]]]))
    with pytest.raises(ValueError, match="slot 0 has no table covering 9 tokens"):
        batch.apply(BatchUpdate(BLOCK, tables=[[0, 0, [1, 2]]], seqs=[[0, 8, [1], 0]]))
    stale = BatchUpdate(BLOCK)
    stale.version = 0
    with pytest.raises(ValueError, match="step message version 0; this worker reads version 2"):
        BatchUpdate.from_bytes(stale.to_bytes())
