"""Which KV cache blocks each sequence owns. Pure CPU bookkeeping; the cache tensors live with the
runner."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow seq_id's block table to cover num_tokens tokens; returns the table."""
        table = self.block_tables.setdefault(seq_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra > self.num_free_blocks:
            raise OutOfBlocksError(f"need {extra} more KV blocks, {self.num_free_blocks} free")
        for _ in range(extra):
            table.append(self.free_blocks.pop())
        return table

    def free(self, seq_id: str) -> None:
        self.free_blocks.extend(reversed(self.block_tables.pop(seq_id, [])))
