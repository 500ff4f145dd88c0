"""Pre-warming: which prefixes count as hot, and what is sent to a joining worker."""
from __future__ import annotations

import json

from router.fleet.prewarm import HotPrefixes, warm_body

PATH = "/v1/completions"


def _body(i: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"document {i}", "max_tokens": 50}).encode()


def test_the_hottest_prefixes_come_first_with_their_latest_sample():
    hot = HotPrefixes(capacity=8, max_body_bytes=1024)
    for key, count in ((1, 3), (2, 5), (3, 1)):
        for n in range(count):
            hot.record(key, PATH, "m", _body(10 * key + n), now=100.0)
    top = hot.top(2, now=100.0)
    assert [(t.key, t.score, t.body) for t in top] == [(2, 5.0, _body(24)), (1, 3.0, _body(12))]


def test_counts_decay_so_yesterdays_hot_prefix_gives_way_to_todays():
    hot = HotPrefixes(capacity=8, max_body_bytes=1024, half_life_s=60.0)
    for _ in range(8):
        hot.record(1, PATH, "m", _body(1), now=0.0)
    for _ in range(3):
        hot.record(2, PATH, "m", _body(2), now=240.0)  # 4 half-lives later: 8 -> 0.5
    assert [t.key for t in hot.top(2, now=240.0)] == [2, 1]


def test_a_flood_of_one_off_prompts_neither_crowds_out_a_heavy_hitter_nor_looks_hot():
    hot = HotPrefixes(capacity=4, max_body_bytes=1024)
    for key in range(1000, 1400):  # distinct prompts, each seen once, and every other one is key 7
        hot.record(key, PATH, "m", _body(key), now=1.0)
        if key % 2 == 0:
            hot.record(7, PATH, "m", _body(7), now=1.0)
    assert len(hot) == 4
    top = hot.top(4, now=1.0)
    assert (top[0].key, top[0].hits(1.0, 300.0)) == (7, 200.0)
    assert all(t.hits(1.0, 300.0) == 1.0 for t in top[1:])  # inherited counts do not rank


def test_oversized_bodies_are_counted_but_never_kept_and_other_models_are_skipped():
    hot = HotPrefixes(capacity=8, max_body_bytes=len(_body(3)))
    hot.record(1, PATH, "m", b"x" * (len(_body(3)) + 1), now=0.0)
    hot.record(2, PATH, "other", _body(2), now=0.0)
    hot.record(3, PATH, "m", _body(3), now=0.0)
    assert [t.key for t in hot.top(8, now=0.0, models=("m",))] == [3]


def test_a_warm_request_is_the_same_prompt_for_one_token_without_streaming():
    sample = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
                         "max_completion_tokens": 900, "stream": True, "stream_options": {"include_usage": True},
                         "n": 3, "logprobs": True, "top_logprobs": 2, "cache_salt": "tenant-9"}).encode()
    assert json.loads(warm_body(sample)) == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 1, "cache_salt": "tenant-9"}
