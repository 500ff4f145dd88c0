"""The prefix cache: chained 128-bit block hashes, namespaces, hits, the recomputed last token."""
from __future__ import annotations

from array import array

import xxhash

from worker.engine.kv_cache import BlockStored, KVCacheManager, hash_block_tokens, hash_request_blocks
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence


def make_seq(rid: str, tokens: list[int], namespace: int = 0) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), namespace=namespace)


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit ``seq`` like the scheduler does, compute all its tokens, cache them; return hits."""
    hits, n = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - n, hits)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return n


def test_block_hash_is_xxh3_128_over_parent_bytes_and_int64_tokens_seeded_by_namespace():
    first = xxhash.xxh3_128_intdigest(array("q", [1, 2]).tobytes(), seed=42)
    assert hash_block_tokens(None, [1, 2], 42) == first
    second = xxhash.xxh3_128_intdigest(first.to_bytes(16, "little") + array("q", [3, 4]).tobytes(), seed=42)
    assert hash_block_tokens(first, [3, 4], 42) == second
    assert hash_request_blocks([1, 2, 3, 4, 5], 2, 42) == [first, second]


def test_a_block_hash_names_the_whole_prefix_not_just_the_block():
    a = hash_request_blocks([1, 2, 9, 9], 2, 0)
    b = hash_request_blocks([5, 6, 9, 9], 2, 0)
    assert a[1] != b[1]


def test_namespaces_never_share_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, make_seq("a", list(range(9)), namespace=1))
    assert admit(kv, make_seq("b", list(range(9)), namespace=2)) == 0
    assert admit(kv, make_seq("c", list(range(9)), namespace=1)) == 8


def test_a_full_prompt_hit_still_recomputes_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, make_seq("a", list(range(8))))
    seq = make_seq("b", list(range(8)))
    hits, n = kv.get_computed_blocks(seq)
    # 8 tokens = 2 full blocks, but the block holding token 7 is recomputed.
    assert n == 4 and [b.block_id for b in hits] == [0]


def test_a_partial_prefix_hits_only_the_shared_full_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_seq("a", list(range(12))))
    seq = make_seq("b", list(range(10)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(seq)
    assert n == 8 and [b.block_id for b in hits] == [0, 1]


def test_blocks_are_registered_only_once_their_kv_is_written():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))
    hits, n = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, 6, hits)  # a first chunk of 6 tokens
    assert kv.block_pool.take_events() == []
    assert kv.get_computed_blocks(make_seq("probe", list(range(10))))[1] == 0
    seq.num_computed_tokens = 6
    kv.cache_computed_blocks(seq)
    assert kv.block_pool.take_events() == [BlockStored(seq.block_hashes[:1])]
    assert kv.get_computed_blocks(make_seq("probe", list(range(10))))[1] == 4


def test_allocation_counts_unreferenced_hits_against_the_free_blocks():
    # 3 blocks: "a" caches 2 blocks and frees them. "b" hits both, which leaves 1 allocatable
    # block, so it cannot also take 2 new ones.
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.allocate_slots(b, 5, hits) is False
    assert kv.block_pool.get_num_free_blocks() == 3
    assert kv.allocate_slots(b, 2, hits) is True
    assert [blk.block_id for blk in b.blocks] == [0, 1, 2]


def test_freeing_a_request_keeps_its_blocks_cached_and_ref_counts_return_to_zero():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    b = make_seq("b", [1, 2, 3, 4, 5])
    admit(kv, b)
    assert [blk.ref_cnt for blk in b.blocks[:2]] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert kv.block_pool.num_cached_free_blocks == 2
    kv.block_pool.check_invariants()
