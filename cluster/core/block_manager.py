"""KV cache blocks: who owns which, and which full blocks can be reused by content (prefix caching).

Pure CPU bookkeeping; the cache tensors live with the runner. A full block is named by a hash of
its tokens chained with the hash of the block before it, so equal hashes mean equal prefixes and
therefore equal keys/values. Blocks nobody holds stay cached until the space is needed, evicted
least recently freed first.

With an EAGLE-3 draft the block also holds the draft's KV, whose entry at the block's last position
pairs it with the token after the block (spec_decode/eagle3.py). Such a block is cached under its hash
and that next token (key_by_next_token), so it serves only requests that continue it the same way.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks for an allocation: the scheduler preempts instead (never a user's error)."""


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Content name of one full block: sha256(parent hash || tokens)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of the full blocks of token_ids: 10 tokens, block 4 -> hashes of [0:4] and [0:8]."""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 key_by_next_token: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_by_next_token = key_by_next_token
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # cache key (content hash, see _cache_key) -> block id
        # Blocks held by nobody, least recently freed first; cached ones among them can still be hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        # Content hashes of each sequence's leading full blocks, whether or not its block is the cached copy.
        self.seq_hashes: dict[str, list[bytes]] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """Give a new sequence the cached blocks its tokens start with; returns how many tokens they
        cover. The last token is always left to compute: its logits are needed."""
        assert seq_id not in self.block_tables, f"{seq_id} already holds blocks"
        table: list[int] = []
        self.block_tables[seq_id] = table
        self.seq_hashes[seq_id] = []
        if not self.enable_prefix_caching:
            return 0
        for i, block_hash in enumerate(prefix_block_hashes(token_ids[: len(token_ids) - 1], self.block_size)):
            block = self.cached.get(self._cache_key(block_hash, token_ids, i))
            if block is None:
                break
            self._take(block)
            table.append(block)
            self.seq_hashes[seq_id].append(block_hash)
        return len(table) * self.block_size

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        held = len(self.block_tables.get(seq_id, ()))
        return self.blocks_needed(num_tokens) - held <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow seq_id's block table to cover num_tokens tokens; returns the table."""
        table = self.block_tables.setdefault(seq_id, [])
        self.seq_hashes.setdefault(seq_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra > self.num_free_blocks:
            raise OutOfBlocksError(f"need {extra} more KV blocks, {self.num_free_blocks} free")
        for _ in range(extra):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            table.append(block)
        return table

    def cache_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Enter the blocks of seq_id that are full of computed tokens into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.block_tables[seq_id], self.seq_hashes[seq_id]
        for i in range(len(hashes), min(num_computed // self.block_size, len(table))):
            block_tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = hash_block(hashes[-1] if hashes else b"", block_tokens)
            key = self._cache_key(block_hash, token_ids, i)
            if key is None:  # the token after the block is not known yet
                break
            hashes.append(block_hash)
            # If equal content is already cached in another block, this copy stays private.
            if key not in self.cached:
                self.block_hash[table[i]] = key
                self.cached[key] = table[i]

    def _cache_key(self, block_hash: bytes, token_ids: list[int], index: int) -> bytes | None:
        """What block `index` of token_ids is cached under: its content hash, followed by the token
        after it when key_by_next_token (None while that token is unknown)."""
        if not self.key_by_next_token:
            return block_hash
        after = (index + 1) * self.block_size
        return block_hash + array("q", [token_ids[after]]).tobytes() if after < len(token_ids) else None

    def free(self, seq_id: str) -> None:
        """Release seq_id's blocks; the tail goes to the free queue first so that it is evicted
        before the shared prefix is."""
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        self.seq_hashes.pop(seq_id, None)

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None
