"""The hosted TTL cache replayed over requests: reads, writes, refreshes, expiry and episodes."""
from __future__ import annotations

import pytest

from bench.cost.ttl_cache import replay_ttl_cache
from bench.workloads.base import RequestSpec

DOC, Q = 1_000, 2_000  # content ids


def _req(i, t, *segments, out=5):
    return RequestSpec(i, t, tuple(segments), out)


def test_a_read_within_the_ttl_refreshes_and_an_expired_prefix_is_written_again():
    # An 8-token document (two 4-token blocks) and a 2-token question (a partial block, never cached).
    reqs = [_req(0, 0.0, (DOC, 8), (Q + 0, 2)), _req(1, 100.0, (DOC, 8), (Q + 1, 2)),
            _req(2, 350.0, (DOC, 8), (Q + 2, 2)), _req(3, 800.0, (DOC, 8), (Q + 3, 2))]
    replay = replay_ttl_cache(reqs, ttl_s=300, block_tokens=4)
    # 0 writes both blocks; 1 reads them (lifetime now ends at 400); 2 reads at 350 (ends at 650);
    # 3 comes at 800, after expiry: it writes again.
    assert [(u.read_tokens, u.write_tokens, u.plain_tokens) for u in replay.uses] == [
        (0, 8, 2), (8, 0, 2), (8, 0, 2), (0, 8, 2)]
    assert [(e.depth, e.written_s, e.reads, e.censored) for e in replay.episodes] == [
        (1, 0.0, 2, False), (2, 0.0, 2, False), (1, 800.0, 0, True), (2, 800.0, 0, True)]


def test_a_longer_ttl_keeps_the_prefix_across_the_gap():
    reqs = [_req(0, 0.0, (DOC, 8)), _req(1, 1_000.0, (DOC, 8))]
    assert [u.read_tokens for u in replay_ttl_cache(reqs, 300, 4).uses] == [0, 0]
    assert [u.read_tokens for u in replay_ttl_cache(reqs, 3_600, 4).uses] == [0, 8]


def test_requests_share_exactly_their_common_leading_blocks():
    reqs = [_req(0, 0.0, (DOC, 8), (Q + 0, 4)), _req(1, 1.0, (DOC, 8), (Q + 1, 4)), _req(2, 2.0, (DOC + 1, 12))]
    uses = replay_ttl_cache(reqs, 300, 4).uses
    assert [(u.read_tokens, u.write_tokens) for u in uses] == [(0, 12), (8, 4), (0, 12)]


def test_prompts_below_the_minimum_neither_read_nor_write():
    reqs = [_req(0, 0.0, (DOC, 8)), _req(1, 1.0, (DOC, 8)), _req(2, 2.0, (DOC, 16)), _req(3, 3.0, (DOC, 16))]
    uses = replay_ttl_cache(reqs, 300, 4, min_cacheable_tokens=12).uses
    assert [(u.read_tokens, u.write_tokens, u.plain_tokens) for u in uses] == [
        (0, 0, 8), (0, 0, 8), (0, 16, 0), (16, 0, 0)]


def test_without_a_ttl_the_cache_never_expires():
    reqs = [_req(0, 0.0, (DOC, 4)), _req(1, 1e9, (DOC, 4))]
    assert [u.read_tokens for u in replay_ttl_cache(reqs, None, 4).uses] == [0, 4]


def test_arrival_order_decides_not_list_order():
    reqs = [_req(1, 10.0, (DOC, 4)), _req(0, 0.0, (DOC, 4))]
    uses = replay_ttl_cache(reqs, 300, 4).uses
    assert [(u.index, u.read_tokens) for u in uses] == [(0, 0), (1, 4)]


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0}, {"ttl_s": 300, "block_tokens": 0}])
def test_nonsense_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        replay_ttl_cache([], **kwargs)
