"""UsageTap's bounds (router/http/sse.py): a worker that never ends an event cannot make the
router hold or rescan an unbounded tail."""
from __future__ import annotations

import pytest

from router.http.sse import MAX_EVENT_BYTES, EventTooLarge, UsageTap


def test_a_separator_split_across_chunks_is_still_found():
    tap = UsageTap(strip=False)
    assert tap.feed(b'data: {"a": 1}\n') == b""
    assert tap.feed(b'\ndata: [DONE]\n\n') == b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert tap.done
    tap = UsageTap(strip=False)
    assert tap.feed(b'data: {"a": 1}\r\n\r') == b""
    assert tap.feed(b"\n") == b'data: {"a": 1}\r\n\r\n'


def test_an_event_that_never_ends_is_refused_past_the_bound():
    tap = UsageTap(strip=False)
    chunk = b"data: " + b"x" * (1 << 20)
    with pytest.raises(EventTooLarge):
        for _ in range(MAX_EVENT_BYTES // len(chunk) + 2):
            assert tap.feed(chunk) == b""
