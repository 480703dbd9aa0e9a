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
