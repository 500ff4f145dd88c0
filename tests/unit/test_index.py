"""PrefixIndex: exact matches per worker, TTLs, KV-event semantics, LRU bound."""
from __future__ import annotations

from router.routing.index import PrefixIndex

CHAIN = [101, 102, 103, 104, 105, 106]  # chain hashes h_1..h_6 of one prompt


def test_a_worker_matches_the_leading_hashes_it_holds():
    index = PrefixIndex()
    index.insert(CHAIN[:4], "A", now=0.0, confirmed=True)
    index.insert(CHAIN[:2], "B", now=0.0, confirmed=True)
    assert index.match(CHAIN, now=1.0) == {"A": 4, "B": 2}


def test_a_prompt_whose_first_chunk_is_unknown_matches_nothing():
    index = PrefixIndex()
    index.insert(CHAIN[1:], "A", now=0.0, confirmed=True)
    assert index.match(CHAIN, now=1.0) == {}
    assert index.match([], now=1.0) == {}


def test_the_walk_stops_at_the_first_hash_a_worker_lacks():
    # A removed event for h_3 ends A's prefix there even though h_4.. are still recorded.
    index = PrefixIndex()
    index.insert(CHAIN, "A", now=0.0, confirmed=True)
    index.insert(CHAIN, "B", now=0.0, confirmed=True)
    index.remove([CHAIN[2]], "A")
    assert index.match(CHAIN, now=1.0) == {"A": 2, "B": 6}


def test_optimistic_entries_expire_unless_confirmed():
    index = PrefixIndex(optimistic_ttl_s=10.0, confirmed_ttl_s=100.0)
    index.insert(CHAIN, "A", now=0.0, confirmed=False)
    index.insert(CHAIN[:3], "A", now=5.0, confirmed=True)
    assert index.match(CHAIN, now=9.0) == {"A": 6}
    assert index.match(CHAIN, now=11.0) == {"A": 3}
    assert index.match(CHAIN, now=106.0) == {}


def test_an_optimistic_insert_never_shortens_a_confirmed_entry():
    index = PrefixIndex(optimistic_ttl_s=10.0, confirmed_ttl_s=100.0)
    index.insert(CHAIN, "A", now=0.0, confirmed=True)
    index.insert(CHAIN, "A", now=1.0, confirmed=False)
    assert index.match(CHAIN, now=50.0) == {"A": 6}


def test_demoted_entries_live_only_the_optimistic_ttl():
    index = PrefixIndex(optimistic_ttl_s=10.0, confirmed_ttl_s=100.0)
    index.insert(CHAIN, "A", now=0.0, confirmed=True)
    index.demote(CHAIN[2:], "A", now=20.0)
    assert index.match(CHAIN, now=29.0) == {"A": 6}
    assert index.match(CHAIN, now=31.0) == {"A": 2}


def test_clearing_a_worker_forgets_only_that_worker_and_it_can_be_refilled():
    index = PrefixIndex()
    index.insert(CHAIN, "A", now=0.0, confirmed=True)
    index.insert(CHAIN[:3], "B", now=0.0, confirmed=True)
    index.clear_worker("A")
    assert index.match(CHAIN, now=1.0) == {"B": 3}
    index.insert(CHAIN[:1], "A", now=2.0, confirmed=True)
    assert index.match(CHAIN, now=3.0) == {"A": 1, "B": 3}


def test_the_index_stays_bounded_under_a_flood_of_distinct_prompts_and_keeps_the_recent_ones():
    index = PrefixIndex(max_entries=1000)
    for i in range(500):  # 500 distinct prompts of 8 chunks: 4,000 hashes offered
        chain = [i * 1000 + j for j in range(8)]
        index.insert(chain, f"w{i % 4}", now=float(i), confirmed=False)
    assert len(index) == 1000
    assert index.stats.evicted_lru == 3000
    newest = [499 * 1000 + j for j in range(8)]
    oldest = [0 * 1000 + j for j in range(8)]
    assert index.match(newest, now=500.0) == {"w3": 8}
    assert index.match(oldest, now=500.0) == {}


def test_a_matched_prefix_becomes_most_recently_used_and_survives_eviction():
    index = PrefixIndex(max_entries=6)
    index.insert([1, 2, 3], "A", now=0.0, confirmed=True)
    index.insert([4, 5, 6], "B", now=0.0, confirmed=True)
    assert index.match([1, 2, 3], now=1.0) == {"A": 3}
    index.insert([7, 8, 9], "C", now=2.0, confirmed=True)  # evicts 4, 5, 6: the least recently used
    assert index.match([1, 2, 3], now=3.0) == {"A": 3}
    assert index.match([4, 5, 6], now=3.0) == {}


def test_sweep_deletes_expired_and_cleared_entries():
    index = PrefixIndex(optimistic_ttl_s=10.0)
    index.insert([1, 2], "A", now=0.0, confirmed=False)
    index.insert([3, 4], "B", now=0.0, confirmed=True)
    index.insert([5], "C", now=0.0, confirmed=True)
    index.clear_worker("C")
    assert index.sweep(now=11.0) == 3
    assert len(index) == 2
    assert index.match([3, 4], now=11.0) == {"B": 2}


def test_entries_round_trip_through_a_snapshot():
    index = PrefixIndex()
    index.insert(CHAIN[:3], "A", now=0.0, confirmed=True)
    index.insert(CHAIN[:2], "B", now=0.0, confirmed=False)
    items = list(index.entries(now=10.0))
    fresh = PrefixIndex()
    assert fresh.load_entries(items, now=1000.0) == 5
    assert fresh.match(CHAIN, now=1000.0) == {"A": 3, "B": 2}
    # The optimistic entries kept their remaining life (30 s - 10 s elapsed), not a new one.
    assert fresh.match(CHAIN, now=1021.0) == {"A": 3}


def test_entries_can_be_exported_in_slices_while_the_index_changes():
    index = PrefixIndex(optimistic_ttl_s=10.0)
    index.insert([1, 2, 3], "A", now=0.0, confirmed=True)
    index.insert([4], "B", now=0.0, confirmed=False)
    hashes = index.hash_list()
    index.remove([2], "A")  # changed after the hash list was taken
    assert hashes == [1, 2, 3, 4]
    assert index.entries_for(hashes[:2], now=5.0) == [(1, "A", 3595.0)]
    assert index.entries_for(hashes[2:], now=11.0) == [(3, "A", 3589.0)]  # B's entry expired


def test_with_more_holders_than_the_limit_only_the_longest_matches_are_listed():
    # A system prompt (h_1, h_2) every worker holds; two of them hold longer prefixes.
    index = PrefixIndex()
    for w in range(10):
        index.insert(CHAIN[:2], f"w{w}", now=0.0, confirmed=True)
    index.insert(CHAIN[:5], "w7", now=0.0, confirmed=True)
    index.insert(CHAIN[:4], "w3", now=0.0, confirmed=True)
    top, complete = index.match_top(CHAIN, now=1.0, limit=3)
    assert not complete
    assert (len(top), top["w7"], top["w3"]) == (3, 5, 4)
    assert list(top.values())[2] == 2  # one of the system-prompt holders
    assert index.depth_of(CHAIN, "w5", now=1.0) == 2
    assert index.depth_of(CHAIN, "nobody", now=1.0) == 0
    # Under the limit the answer is the full, exact one.
    assert index.match_top(CHAIN, now=1.0, limit=None) == (index.match(CHAIN, now=1.0), True)
    assert len(index.match(CHAIN, now=1.0)) == 10


def test_the_longest_match_search_skips_expired_and_cleared_holders():
    index = PrefixIndex(optimistic_ttl_s=10.0)
    for w in range(5):
        index.insert(CHAIN[:2], f"w{w}", now=0.0, confirmed=True)
    index.insert(CHAIN, "w1", now=0.0, confirmed=False)   # expires at 10
    index.insert(CHAIN[:4], "w2", now=0.0, confirmed=True)
    index.clear_worker("w2")
    top, _ = index.match_top(CHAIN, now=11.0, limit=2)
    assert set(top.values()) == {2}


def test_a_hash_missing_in_the_middle_of_a_popular_chain_ends_every_match_there():
    # Seen in a multi-turn sweep: the longest-match search found live holders deep in a chain
    # whose h_2 no worker held any more (its last holder's block was evicted), and then raised
    # KeyError touching h_2. A prefix cache never serves past a missing block: every match ends at 1.
    index = PrefixIndex()
    for w in range(3):
        index.insert(CHAIN[:2], f"w{w}", now=0.0, confirmed=True)
    index.insert(CHAIN, "w0", now=0.0, confirmed=True)
    for w in range(3):
        index.remove([CHAIN[1]], f"w{w}")
    top, complete = index.match_top(CHAIN, now=1.0, limit=2)
    assert not complete
    assert list(top.values()) == [1, 1]
    assert index.match(CHAIN, now=1.0) == {"w0": 1, "w1": 1, "w2": 1}



def test_a_long_single_holder_chain_matches_and_refreshes_like_a_short_one():
    # Chains longer than a couple of hundred hashes are walked by C iterators instead of a loop:
    # the same match, and the same most-recently-used order (hence the same evictions).
    for length in (50, 1000):
        chain = list(range(1, length + 1))
        held = length - 7
        index = PrefixIndex(max_entries=length + 3, optimistic_ttl_s=10.0, confirmed_ttl_s=100.0)
        index.insert([-1, -2, -3], "B", now=0.0, confirmed=True)
        index.insert(chain[:held], "A", now=0.0, confirmed=True)
        index.insert(chain[held:], "A", now=0.0, confirmed=False)
        assert index.match(chain, now=5.0) == {"A": length}
        assert index.match(chain, now=20.0) == {"A": held}  # the optimistic tail expired
        # That match made chain[:held] the most recently used, in chain order: ten new entries
        # evict B's three and the tail's seven, the next two chain[0] and chain[1].
        index.insert(list(range(10_001, 10_011)), "C", now=20.0, confirmed=True)
        assert index.match([-1, -2, -3], now=20.0) == {}
        index.insert([10_011, 10_012], "C", now=20.0, confirmed=True)
        assert index.match(chain, now=20.0) == {}
        assert index.match(chain[1:], now=20.0) == {}
        assert index.match(chain[2:], now=20.0) == {"A": held - 2}
