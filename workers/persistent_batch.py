"""The step message to ranks 1..N-1: updates to a batch each rank keeps, not the whole step.

A rank learns a request's block table once, then only the blocks appended to it; each step names the
scheduled requests by a small slot number with their new tokens. The rank rebuilds the StepInput
itself. A decode step of 8 sequences is then ~130 bytes whatever the context length, where the full
StepInput carries every block table again (a Maverick context of 4,096 tokens is 256 block ids per
sequence, per step).

    coordinator: BatchMirror.update(plan) -> BatchUpdate --msgpack--> rank r: PersistentBatch.apply -> StepInput

The mirror must know what every rank holds, so a step that failed anywhere makes the next update a
reset that sends the scheduled requests' tables whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from warpspec.workers import wire
from warpspec.workers.step import SequenceStep, StepInput

VERSION = 2  # of the message layout; a rank refuses another


@dataclass
class BatchUpdate:
    block_size: int
    # [slot, num_cached, token_ids, logits_from] per scheduled sequence, in the step's order.
    seqs: list[list] = field(default_factory=list)
    # [slot, start, block ids]: the slot's table from index `start` on (0: the whole table, new or replaced).
    tables: list[list] = field(default_factory=list)
    # [slot, group, start, block ids]: the same for a hybrid KV cache's chunked groups' tables (their
    # entries before the current chunk are stale and never read, so they only grow, as `tables`).
    window_tables: list[list] = field(default_factory=list)
    chunk_size: int | None = None
    forget: list[int] = field(default_factory=list)  # slots of requests that left
    aux_layer_ids: list[int] = field(default_factory=list)
    reset: bool = False  # forget every slot first
    version: int = VERSION

    def to_bytes(self) -> bytes:
        return wire.encode({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_bytes(cls, data: bytes) -> BatchUpdate:
        message = wire.decode(data)
        if message.get("version") != VERSION:
            raise ValueError(f"step message version {message.get('version')!r}; this worker reads version "
                             f"{VERSION} (coordinator and workers run different warpspec versions)")
        return cls(**message)


@dataclass
class _Sent:
    slot: int
    table: list[int]  # the engine's own list, which grows in place while the request holds its blocks
    num_sent: int
    windows: list[list[int]] = field(default_factory=list)  # the engine's window tables, the same way
    num_sent_windows: list[int] = field(default_factory=list)


class BatchMirror:
    """The coordinator's record of what ranks 1..N-1 hold, and the update that brings them to a plan."""

    def __init__(self):
        self.sent: dict[str, _Sent] = {}
        self.free_slots: list[int] = []
        self.needs_reset = False

    def update(self, seqs: list[SequenceStep], block_size: int, aux_layer_ids: list[int],
              left_request_ids: list[str], chunk_size: int | None = None) -> BatchUpdate:
        update = BatchUpdate(block_size, aux_layer_ids=list(aux_layer_ids), reset=self.needs_reset,
                             chunk_size=chunk_size)
        if self.needs_reset:
            self.sent.clear()
            self.free_slots.clear()
            self.needs_reset = False
        for request_id in left_request_ids:
            sent = self.sent.pop(request_id, None)
            if sent is not None:
                update.forget.append(sent.slot)
                self.free_slots.append(sent.slot)
        for seq in seqs:
            sent = self.sent.get(seq.request_id)
            if sent is None:
                slot = self.free_slots.pop() if self.free_slots else len(self.sent) + len(self.free_slots)
                sent = self.sent[seq.request_id] = _Sent(slot, seq.block_table, 0)
            elif sent.table is not seq.block_table:
                # A request that lost its blocks (preempted) comes back with a new table: send it whole.
                sent.table, sent.num_sent = seq.block_table, 0
            if len(seq.block_table) > sent.num_sent:
                update.tables.append([sent.slot, sent.num_sent, seq.block_table[sent.num_sent:]])
                sent.num_sent = len(seq.block_table)
            if sent.windows is not seq.window_tables:  # new, or back from a preemption
                sent.windows, sent.num_sent_windows = seq.window_tables, [0] * len(seq.window_tables)
            for group, table in enumerate(seq.window_tables):
                if len(table) > sent.num_sent_windows[group]:
                    update.window_tables.append([sent.slot, group, sent.num_sent_windows[group],
                                                 table[sent.num_sent_windows[group]:]])
                    sent.num_sent_windows[group] = len(table)
            update.seqs.append([sent.slot, seq.num_cached, seq.token_ids, seq.logits_from])
        return update


class PersistentBatch:
    """A rank's block tables by slot, kept in step with the coordinator's BatchMirror."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}
        self.windows: dict[int, list[list[int]]] = {}  # a hybrid KV cache's chunked groups' tables

    def apply(self, update: BatchUpdate) -> StepInput:
        if update.reset:
            self.tables.clear()
            self.windows.clear()
        for slot in update.forget:
            self.tables.pop(slot, None)
            self.windows.pop(slot, None)
        for slot, start, blocks in update.tables:
            if start == 0:
                self.tables[slot] = list(blocks)
                self.windows.pop(slot, None)
                continue
            _extend(self.tables.get(slot), start, blocks, f"slot {slot}")
        for slot, group, start, blocks in update.window_tables:
            windows = self.windows.setdefault(slot, [])
            if start == 0:
                windows.extend([] for _ in range(group + 1 - len(windows)))
                windows[group] = list(blocks)
                continue
            _extend(windows[group] if group < len(windows) else None, start, blocks, f"slot {slot}'s group {group}")
        seqs = []
        for slot, num_cached, token_ids, logits_from in update.seqs:
            table = self.tables.get(slot)
            if table is None or len(table) * update.block_size < num_cached + len(token_ids):
                raise ValueError(f"step message out of step: slot {slot} has no table covering "
                                 f"{num_cached + len(token_ids)} tokens")
            seqs.append(SequenceStep(token_ids, num_cached, table, logits_from,
                                     window_tables=self.windows.get(slot, [])))
        return StepInput.build(seqs, update.block_size, update.aux_layer_ids, update.chunk_size)


def _extend(table: list[int] | None, start: int, blocks: list[int], name: str) -> None:
    if table is None or len(table) != start:
        raise ValueError(f"step message out of step: {name} holds "
                         f"{'no table' if table is None else f'{len(table)} blocks'}, the message "
                         f"appends from block {start}")
    table.extend(blocks)
