"""KV block bookkeeping on its own: tables grow by whole blocks, full blocks are shared by content
through chained hashes, freed blocks stay cached until their space is needed (least recently freed
first), and with a draft a block is shared only by requests that continue it with the same token."""

import pytest

from warpspec.core.block_manager import BlockManager, OutOfBlocksError, prefix_block_hashes

BLOCK = 4


def test_a_table_grows_by_whole_blocks_and_refuses_beyond_the_free_ones():
    blocks = BlockManager(num_blocks=3, block_size=BLOCK)
    assert blocks.allocate("a", 5) == [0, 1]  # 5 tokens -> ceil(5 / 4) = 2 blocks
    assert blocks.allocate("a", 8) == [0, 1]  # still 2 blocks
    assert blocks.can_allocate("a", 12) and not blocks.can_allocate("a", 13)
    with pytest.raises(OutOfBlocksError, match="need 2 more KV blocks, 1 free"):
        blocks.allocate("a", 16)
    blocks.free("a")
    assert blocks.num_free_blocks == 3


def test_hashes_chain_so_equal_hashes_mean_equal_prefixes():
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    b = prefix_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2  # 9 tokens: 2 full blocks, the ninth names nothing
    assert a[0] != b[0] and a[1] != b[1]  # the second blocks agree in content, not in what precedes them


def test_a_second_request_reuses_the_cached_full_blocks_and_computes_its_last_token():
    blocks = BlockManager(num_blocks=8, block_size=BLOCK)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks
    assert blocks.match_prefix("a", prompt) == 0
    table = blocks.allocate("a", len(prompt))
    blocks.cache_full_blocks("a", prompt, num_computed=len(prompt))
    # The same 8 leading tokens: both full blocks shared, held twice.
    assert blocks.match_prefix("b", prompt[:8] + [99]) == 8
    assert blocks.block_tables["b"] == table[:2] and [blocks.ref_counts[i] for i in table[:2]] == [2, 2]
    # A prompt of exactly 2 blocks reuses only the first: its last token's logits must be computed.
    assert blocks.match_prefix("c", prompt[:8]) == 4


def test_freed_blocks_stay_cached_until_needed_and_the_tail_is_evicted_first():
    blocks = BlockManager(num_blocks=3, block_size=BLOCK)
    prompt = list(range(30, 39))  # 9 tokens: 3 blocks, 2 of them full and cached
    blocks.match_prefix("a", prompt)
    table = blocks.allocate("a", len(prompt))
    blocks.cache_full_blocks("a", prompt, len(prompt))
    blocks.free("a")
    assert blocks.match_prefix("b", prompt) == 8  # still cached after the free
    blocks.free("b")
    # Free queue [a's tail, b's second block, b's first]: a 1-block request takes the tail, which held
    # no cached content, and the cached prefix survives.
    assert blocks.allocate("c", 4) == [table[2]]
    assert blocks.match_prefix("d", prompt) == 8


def test_never_used_blocks_go_before_freed_ones_so_a_freed_prefix_stays_cached_longest():
    """Blocks never handed out count as freed at start-up, in order, before any freed later: a
    cached prefix is evicted only once they are all taken, and then least recently freed first."""
    blocks = BlockManager(num_blocks=6, block_size=BLOCK)
    prompt = list(range(30, 38))  # 2 full blocks, both cached
    blocks.match_prefix("a", prompt)
    assert blocks.allocate("a", len(prompt)) == [0, 1]
    blocks.cache_full_blocks("a", prompt, len(prompt))
    blocks.free("a")
    assert blocks.num_free_blocks == 6
    assert blocks.allocate("b", 16) == [2, 3, 4, 5]  # the never-used ones, in order
    assert blocks.match_prefix("c", prompt) == 4  # b took no cached block (the last token is always computed)
    blocks.free("c")
    assert blocks.allocate("d", 4) == [1]  # a's tail was freed before its head
    assert blocks.match_prefix("e", prompt) == 4  # its head is still cached


def test_with_a_draft_a_cached_block_serves_only_requests_that_continue_it_the_same_way():
    blocks = BlockManager(num_blocks=8, block_size=BLOCK, key_by_next_token=True)
    prompt = [1, 2, 3, 4, 5, 6]
    blocks.match_prefix("a", prompt)
    blocks.allocate("a", len(prompt))
    blocks.cache_full_blocks("a", prompt, len(prompt))
    assert blocks.match_prefix("same", [1, 2, 3, 4, 5, 9]) == 4  # block [1, 2, 3, 4] followed by 5 again
    assert blocks.match_prefix("other", [1, 2, 3, 4, 7, 9]) == 0  # followed by 7: the draft's KV differs
    # A block whose next token is not known yet is not cached at all.
    blocks.match_prefix("short", [8, 8, 8, 8])
    blocks.allocate("short", 4)
    blocks.cache_full_blocks("short", [8, 8, 8, 8], 4)
    assert blocks.match_prefix("again", [8, 8, 8, 8, 8]) == 0


def hybrid(num_blocks: int, chunk_size: int = 8, **kwargs) -> BlockManager:
    """A hybrid KV cache's bookkeeping: the full group and two chunked groups."""
    return BlockManager(num_blocks, BLOCK, num_window_groups=2, chunk_size=chunk_size, **kwargs)


def test_chunked_groups_give_back_their_blocks_as_a_sequence_crosses_each_chunk():
    blocks = hybrid(num_blocks=40)
    blocks.match_prefix("a", [])
    blocks.allocate("a", 21)  # 6 blocks in each of 3 groups
    assert blocks.num_free_blocks == 40 - 18 and blocks.blocks_held() == [6, 6, 6]
    blocks.release_passed_chunks("a", 21)  # position 21's chunk starts at 16: blocks 0-3 end before it
    assert blocks.num_released_blocks == 2 * 4 and blocks.blocks_held() == [6, 2, 2]
    assert blocks.num_free_blocks == 40 - 18 + 8
    blocks.release_passed_chunks("a", 23)  # same chunk: nothing more
    assert blocks.num_released_blocks == 8
    blocks.allocate("a", 25)  # 7 blocks: one more in each group
    blocks.release_passed_chunks("a", 24)  # chunk [24, 32): blocks 4-5 go too
    assert blocks.blocks_held() == [7, 1, 1] and blocks.num_released_blocks == 12
    assert blocks.window_tables["a"][0][6] == blocks.window_tables["a"][0][-1]  # still indexed by position
    blocks.free("a")
    assert blocks.num_free_blocks == 40 and blocks.blocks_held() == [0, 0, 0]


def test_a_chunk_start_inside_a_block_keeps_that_block():
    blocks = hybrid(num_blocks=40, chunk_size=6)
    blocks.match_prefix("a", [])
    blocks.allocate("a", 14)  # blocks 0-3 (positions 0..15)
    blocks.release_passed_chunks("a", 13)  # chunk [12, 18): block 3 holds 12; blocks 0-2 go
    assert blocks.blocks_held() == [4, 1, 1]
    blocks.release_passed_chunks("a", 12)  # chunk [12, 18) again: nothing
    assert blocks.blocks_held() == [4, 1, 1]


def test_a_growing_sequence_needs_new_blocks_in_every_group():
    blocks = hybrid(num_blocks=9)
    blocks.match_prefix("a", [])
    assert blocks.num_blocks_to_grow("a", 8) == 6 and blocks.can_allocate("a", 12)
    assert not blocks.can_allocate("a", 13)  # 4 blocks x 3 groups > 9
    with pytest.raises(OutOfBlocksError, match="need 12 more KV blocks, 9 free"):
        blocks.allocate("a", 13)


def test_a_hybrid_prefix_hit_needs_the_whole_prefix_in_the_full_group_and_its_last_chunk_in_the_others():
    prompt = list(range(100, 123))  # 23 tokens: 5 full blocks (positions 0..19)
    plain, blocks = BlockManager(num_blocks=64, block_size=BLOCK), hybrid(num_blocks=64)
    for manager in (plain, blocks):
        manager.match_prefix("a", prompt)
        manager.allocate("a", len(prompt))
        manager.cache_full_blocks("a", prompt, len(prompt))
        manager.release_passed_chunks("a", len(prompt))  # a's chunked blocks 0-3 go back, still cached
    # The same hit as without the hybrid cache: 5 blocks, resuming at 20, whose chunk starts at 16.
    assert plain.match_prefix("b", prompt) == blocks.match_prefix("b", prompt) == 20
    assert blocks.num_released["b"] == 4  # entries 0-3 of b's chunked tables are stale
    assert blocks.window_tables["b"][1][4] == blocks.window_tables["a"][1][4]  # block 4 shared
    # Evict everything free, a's given-back chunked blocks 0-3 among them. A 13-token prompt could
    # resume at 12, in chunk [8, 16), whose chunked block 2 is gone; resuming at 8, a chunk's start,
    # needs nothing from the chunked groups: 8 tokens hit.
    blocks.free("b")
    blocks.allocate("filler", BLOCK * (blocks.num_free_blocks // 3))
    assert blocks.num_free_blocks == 0
    assert blocks.match_prefix("c", prompt[:13]) == 8
    assert blocks.num_released["c"] == 2 and blocks.window_tables["c"][0] == [0, 0]  # stale entries only
    # A long prompt still hits: blocks 4 (chunk [16, 24)) is held by a.
    assert blocks.match_prefix("d", prompt) == 20
