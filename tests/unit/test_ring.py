"""WorkerRing: placement that independent routers agree on, minimal movement, bounded load."""
from __future__ import annotations

import random

from router.routing.ring import WorkerRing

_RNG = random.Random(7)
KEYS = [_RNG.getrandbits(64) for _ in range(2000)]


def test_two_rings_with_the_same_workers_place_every_key_alike_whatever_the_join_order():
    a = WorkerRing(["w1", "w2", "w3", "w4"])
    b = WorkerRing(["w4", "w2", "w1", "w3"])
    assert [a.owner(k) for k in KEYS] == [b.owner(k) for k in KEYS]


def test_keys_spread_over_all_workers():
    ring = WorkerRing(["w1", "w2", "w3", "w4"])
    counts = {w: 0 for w in ring.members}
    for k in KEYS:
        counts[ring.owner(k)] += 1
    assert all(300 < c < 700 for c in counts.values()), counts  # 500 each on average


def test_removing_a_worker_moves_only_its_keys_to_their_next_worker():
    ring = WorkerRing(["w1", "w2", "w3", "w4"])
    before = {k: ring.successors(k, 2) for k in KEYS}
    ring.remove("w2")
    for k in KEYS:
        owner, second = before[k]
        assert ring.owner(k) == (second if owner == "w2" else owner)


def test_adding_a_worker_takes_keys_only_for_itself():
    ring = WorkerRing(["w1", "w2", "w3"])
    before = {k: ring.owner(k) for k in KEYS}
    ring.add("w4")
    moved = [k for k in KEYS if ring.owner(k) != before[k]]
    assert moved and all(ring.owner(k) == "w4" for k in moved)


def test_successors_are_distinct_and_start_at_the_owner():
    ring = WorkerRing(["w1", "w2", "w3"])
    for k in KEYS[:50]:
        succ = ring.successors(k, 5)
        assert succ[0] == ring.owner(k)
        assert sorted(succ) == ["w1", "w2", "w3"]
        assert list(ring.walk(k)) == succ


def test_an_empty_ring_owns_nothing():
    ring = WorkerRing()
    assert ring.owner(KEYS[0]) is None
    assert ring.successors(KEYS[0], 3) == []
    assert list(ring.walk(KEYS[0])) == []
