"""BlockPool and its free queue: exact block ids, LRU eviction order, ref counts, KV events."""
from __future__ import annotations

import pytest

from worker.engine.kv_cache import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_pops_from_the_head_and_removes_from_the_middle_in_place():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert queue.block_ids() == [2, 1, 3, 4, 0]
    assert queue.num_free_blocks == 5


def test_popping_an_empty_queue_is_an_error():
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError):
        queue.popleft()


def test_a_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(6)
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.free_block_queue.block_ids() == [3, 4, 5]
    pool.check_invariants()


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    # Request A holds blocks 0,1,2 and caches them; it is freed in reverse order so that its
    # tail block (the least likely to be shared) is evicted first, like vLLM does.
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.cache_blocks(a, [100, 101, 102])
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    # New allocations use the never-cached blocks first, then evict 2, then 1.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    assert pool.take_events() == [BlockStored([100, 101, 102]), BlockRemoved([102])]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.take_events() == [BlockRemoved([101])]
    assert pool.get_cached_block(100) is a[0]
    pool.check_invariants()


def test_a_cache_hit_takes_a_block_out_of_the_free_queue_and_refreshes_its_recency():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [7, 8])
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    pool.touch([a[1]])
    assert a[1].ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [2, 3, 0]
    pool.free_blocks([a[1]])
    # Block 1 was used most recently, so it is now evicted after block 0.
    assert pool.free_block_queue.block_ids() == [2, 3, 0, 1]
    pool.check_invariants()


def test_freed_blocks_without_a_hash_are_reused_before_any_cached_block():
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    pool.cache_blocks(a[:2], [1, 2])
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]


def test_a_shared_block_returns_to_the_free_queue_only_when_its_last_reference_drops():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_blocks([b], [55])
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3
    assert pool.num_cached_free_blocks == 1
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])


def test_a_hash_already_cached_elsewhere_does_not_replace_the_cached_block():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a], [9])
    pool.cache_blocks([b], [9])
    assert pool.get_cached_block(9) is a
    assert b.block_hash is None
    assert pool.take_events() == [BlockStored([9])]


def test_allocating_more_blocks_than_are_free_fails_without_changing_anything():
    pool = BlockPool(2)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1


def test_reset_clears_the_cache_only_when_no_block_is_in_use():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.cache_blocks(a, [1, 2])
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(a)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.free_block_queue.block_ids() == [0, 1, 2]
    pool.check_invariants()


def test_caching_is_a_no_op_when_prefix_caching_is_off():
    pool = BlockPool(2, enable_caching=False)
    a = pool.get_new_blocks(1)
    pool.cache_blocks(a, [1])
    assert pool.get_cached_block(1) is None
    assert pool.take_events() == []
