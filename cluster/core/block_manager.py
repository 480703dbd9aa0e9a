"""KV cache blocks: who owns which, and which full blocks can be reused by content (prefix caching).

Pure CPU bookkeeping; the cache tensors live with the runner. A full block is named by a hash of
its tokens chained with the hash of the block before it, so equal hashes mean equal prefixes and
therefore equal keys/values. Blocks nobody holds stay cached until the space is needed, evicted
least recently freed first.

With an EAGLE-3 draft the block also holds the draft's KV, whose entry at the block's last position
pairs it with the token after the block (spec_decode/eagle3.py). Such a block is cached under its hash
and that next token (key_by_next_token), so it serves only requests that continue it the same way,
and only once the draft has read it: the scheduler passes Sequence.num_shareable as what is computed.

A hybrid KV cache (workers/kv_groups.py) gives each sequence one table per KV group over the one
pool: `block_tables` for the full-attention group (the draft's KV follows it) and `window_tables`
for the chunked groups. A chunked group's table stays indexed by position, but the blocks wholly
before the current chunk are given back (release_passed_chunks): their entries go stale, are never
read, and are counted in `num_released`. Chunk 8, block 4, 21 tokens computed: blocks 0-3 (positions
0..15) are given back, blocks 4-5 (16..23) held. Each group caches its own blocks under the same
keys; a prefix is a hit when the full group holds all of it and every chunked group holds the
blocks from its last chunk's start (match_prefix).
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
                 key_by_next_token: bool = False, num_window_groups: int = 0, chunk_size: int | None = None):
        """num_window_groups, chunk_size: a hybrid KV cache's chunked groups and their chunk."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_by_next_token = key_by_next_token
        self.num_window_groups = num_window_groups
        self.chunk_size = chunk_size
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks  # (group, cache key)
        self.cached: dict[tuple[int, bytes], int] = {}  # (group, cache key (see _cache_key)) -> block id
        # Blocks held by nobody, least recently freed first; cached ones among them can still be hit.
        # Blocks never handed out (next_fresh onwards) precede them all, as if freed in order at
        # start-up; kept as a count, not queued: a small model's default cache has millions of blocks,
        # and queueing them took most of an engine's start.
        self.free_queue: OrderedDict[int, None] = OrderedDict()
        self.next_fresh = 0
        self.block_tables: dict[str, list[int]] = {}  # the full-attention group's
        self.window_tables: dict[str, list[list[int]]] = {}  # each chunked group's, by position
        self.num_released: dict[str, int] = {}  # leading window-table entries given back
        self.num_released_blocks = 0  # chunked groups' blocks given back as sequences crossed chunks
        # Content hashes of each sequence's leading full blocks, whether or not its block is the cached copy.
        self.seq_hashes: dict[str, list[bytes]] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_blocks - self.next_fresh

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_groups(self) -> int:
        return 1 + self.num_window_groups

    def window_start_block(self, position: int) -> int:
        """The block holding the start of position's chunk: a chunked group's first live entry."""
        return position // self.chunk_size * self.chunk_size // self.block_size if self.chunk_size else 0

    def match_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """Give a new sequence the cached blocks its tokens start with; returns how many tokens they
        cover. The last token is always left to compute: its logits are needed."""
        assert seq_id not in self.block_tables, f"{seq_id} already holds blocks"
        self.block_tables[seq_id] = []
        self.window_tables[seq_id] = [[] for _ in range(self.num_window_groups)]
        self.num_released[seq_id] = 0
        self.seq_hashes[seq_id] = []
        if not self.enable_prefix_caching:
            return 0
        hashes, keys = prefix_block_hashes(token_ids[: len(token_ids) - 1], self.block_size), []
        for i, block_hash in enumerate(hashes):
            key = self._cache_key(block_hash, token_ids, i)
            if key is None or (0, key) not in self.cached:
                break
            keys.append(key)
        # The chunked groups need the blocks from the last chunk's start of the prefix they resume
        # after; fewer full blocks may be a hit where they are not cached.
        num_hit = len(keys)
        while num_hit and not all((group, keys[i]) in self.cached for group in range(1, self.num_groups)
                                  for i in range(self.window_start_block(num_hit * self.block_size), num_hit)):
            num_hit -= 1
        first = self.window_start_block(num_hit * self.block_size)
        for i in range(num_hit):
            self.block_tables[seq_id].append(self._take((0, keys[i])))
            for group, table in enumerate(self.window_tables[seq_id], start=1):
                table.append(self._take((group, keys[i])) if i >= first else 0)  # 0: stale, never read
        self.num_released[seq_id] = first
        self.seq_hashes[seq_id] = hashes[:num_hit]
        return num_hit * self.block_size

    def num_blocks_to_grow(self, seq_id: str, num_tokens: int) -> int:
        """Free blocks seq_id takes to cover num_tokens tokens, in all groups."""
        held = len(self.block_tables.get(seq_id, ()))
        return max(0, self.blocks_needed(num_tokens) - held) * self.num_groups

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.num_blocks_to_grow(seq_id, num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow seq_id's block tables (every group's) to cover num_tokens tokens; returns the full group's."""
        table = self.block_tables.setdefault(seq_id, [])
        windows = self.window_tables.setdefault(seq_id, [[] for _ in range(self.num_window_groups)])
        self.num_released.setdefault(seq_id, 0)
        self.seq_hashes.setdefault(seq_id, [])
        extra = self.num_blocks_to_grow(seq_id, num_tokens)
        if extra > self.num_free_blocks:
            raise OutOfBlocksError(f"need {extra} more KV blocks, {self.num_free_blocks} free")
        for _ in range(extra // self.num_groups):
            for group_table in (table, *windows):
                block = self._pop_free()
                self.ref_counts[block] = 1
                group_table.append(block)
        return table

    def _pop_free(self) -> int:
        """The least recently freed block, evicted from the prefix cache: a never-used one while any is left."""
        if self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            return self.next_fresh - 1
        block, _ = self.free_queue.popitem(last=False)
        self._evict(block)
        return block

    def release_passed_chunks(self, seq_id: str, num_computed: int) -> None:
        """Give back the chunked groups' blocks that end before the chunk of position num_computed,
        the first one still to compute (or to verify, with drafts): no query reads them again."""
        first = min(self.window_start_block(num_computed), len(self.block_tables.get(seq_id, ())))
        released = self.num_released.get(seq_id, 0)
        if not self.num_window_groups or first <= released:
            return
        for table in self.window_tables[seq_id]:
            for block in table[released:first]:
                self._give_back(block)
        self.num_released_blocks += (first - released) * self.num_window_groups
        self.num_released[seq_id] = first

    def blocks_held(self) -> list[int]:
        """Blocks held per group (full attention first), over every sequence."""
        held = [sum(map(len, self.block_tables.values()))]
        for group in range(self.num_window_groups):
            held.append(sum(len(tables[group]) - self.num_released[seq_id]
                            for seq_id, tables in self.window_tables.items()))
        return held

    def cache_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Enter the blocks of seq_id that are full of computed tokens into the prefix cache, in
        every group that still holds them."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.block_tables[seq_id], self.seq_hashes[seq_id]
        windows, released = self.window_tables[seq_id], self.num_released[seq_id]
        for i in range(len(hashes), min(num_computed // self.block_size, len(table))):
            block_tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = hash_block(hashes[-1] if hashes else b"", block_tokens)
            key = self._cache_key(block_hash, token_ids, i)
            if key is None:  # the token after the block is not known yet
                break
            hashes.append(block_hash)
            self._cache(0, key, table[i])
            if i >= released:
                for group, window in enumerate(windows, start=1):
                    self._cache(group, key, window[i])

    def _cache(self, group: int, key: bytes, block: int) -> None:
        # If equal content is already cached in another block, this copy stays private.
        if (group, key) not in self.cached:
            self.block_hash[block] = (group, key)
            self.cached[group, key] = block

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
        released = self.num_released.pop(seq_id, 0)
        for table in self.window_tables.pop(seq_id, []):
            for block in reversed(table[released:]):
                self._give_back(block)
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self._give_back(block)
        self.seq_hashes.pop(seq_id, None)

    def _give_back(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None

    def _take(self, key: tuple[int, bytes]) -> int:
        block = self.cached[key]
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1
        return block

    def _evict(self, block: int) -> None:
        key = self.block_hash[block]
        if key is not None:
            del self.cached[key]
            self.block_hash[block] = None
