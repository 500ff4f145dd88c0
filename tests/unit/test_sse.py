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


def test_the_stream_ends_at_its_done_event_and_nothing_after_it_is_forwarded():
    """OpenAI's streams end at ``data: [DONE]``: events, a usage chunk or an unfinished tail a worker
    sends after it do not reach the client (the proxy ends the client's answer there)."""
    tap = UsageTap(strip=False)
    assert tap.feed(b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"b": 2}\n\n') == b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert tap.done and tap.events == 2
    assert tap.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 1}}\n\nevent: x\ndata:') == b""
    assert tap.usage is None and tap.flush() == b""


def test_an_event_that_never_ends_is_refused_past_the_bound():
    tap = UsageTap(strip=False)
    chunk = b"data: " + b"x" * (1 << 20)
    with pytest.raises(EventTooLarge):
        for _ in range(MAX_EVENT_BYTES // len(chunk) + 2):
            assert tap.feed(chunk) == b""


def test_token_chunks_with_a_null_usage_are_forwarded_without_being_decoded(monkeypatch):
    import router.http.sse as sse

    def no_decoding(event: bytes):
        raise AssertionError("a token chunk was decoded")

    monkeypatch.setattr(sse, "_data_json", no_decoding)
    tap = UsageTap(strip=True)
    chunks = (b'data: {"choices":[{"text":"say \\"usage\\": 1"}],"usage":null}\n\n'
              b'data: {"choices":[{"text":"b"}], "usage": null}\n\n')
    assert tap.feed(chunks) == chunks
    assert tap.usage is None
    monkeypatch.undo()
    final = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    assert tap.feed(final) == b""  # the usage-only chunk the client did not ask for
    assert tap.usage == {"prompt_tokens": 3, "completion_tokens": 2}
