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


def _naive_split(buffer: bytes, scan_from: int = 0) -> tuple[list[bytes], bytes]:
    """The separators searched for anew after every event (what _split_events finds, slowly)."""
    events, start = [], 0
    while True:
        found = [(i, len(sep)) for sep in (b"\n\n", b"\r\n\r\n") if (i := buffer.find(sep, max(start, scan_from))) >= 0]
        if not found:
            return events, buffer[start:]
        i, n = min(found)
        events.append(buffer[start:i + n])
        start = i + n


PIECES = [b"\n", b"\n\n", b"\r\n", b"\r\n\r\n", b"\r", b"data: ", b'{"a":1}', b"[DONE]", b'"usage":null',
          b'"usage": null', b'"usage":{"prompt_tokens":2}', b'{"choices":[],"usage":{"prompt_tokens":4}}',
          b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":5}}', b"x", b'"usage"']


def test_split_events_finds_what_a_search_after_every_event_finds() -> None:
    import random

    from router.http.sse import _split_events

    rng = random.Random(1)
    for _ in range(20_000):
        buffer = b"".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 12)))
        scan_from = rng.randrange(0, len(buffer) + 1)
        assert _split_events(buffer, scan_from) == _naive_split(buffer, scan_from), (buffer, scan_from)


def _tap_run(reads: list[bytes], strip: bool, fast: bool, monkeypatch, took: list[int] | None = None) -> list:
    """What a tap gives for ``reads``; ``fast``: with ``_plain_events`` (each read it passed in one
    piece counted in ``took[0]``), else without it."""
    import router.http.sse as sse

    if fast:
        plain = sse._plain_events

        def counted(buffer: bytes):
            passed = plain(buffer)
            took[0] += passed is not None
            return passed

        monkeypatch.setattr(sse, "_plain_events", counted)
    else:
        monkeypatch.setattr(sse, "_plain_events", lambda buffer: None)
    tap = UsageTap(strip=strip)
    out: list = []
    try:
        for data in reads:
            out.append(tap.feed(data))
        out.append(tap.flush())
    except EventTooLarge:
        out.append("too large")
    monkeypatch.undo()
    return [*out, tap.usage, tap.done, tap.events]


def test_whole_reads_of_plain_events_pass_as_event_by_event(monkeypatch) -> None:
    """A read of token events forwarded in one piece (``_plain_events``) gives the client the same
    bytes, usage, end and event count as the event-by-event loop, on random streams cut at
    random places (usage chunks, ``[DONE]``, CRLF separators, runs of newlines among them)."""
    import random

    rng = random.Random(2)
    token = b'data: {"id":"c","choices":[{"text":"t"}],"usage":null}\n\n'
    took = [0]
    for _ in range(5_000):
        stream = b"".join(rng.choice([token] * 6 + [p + rng.choice([b"\n\n", b""]) for p in PIECES])
                          for _ in range(rng.randrange(0, 10)))
        cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randrange(0, 5)))) if stream else []
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        strip = rng.random() < 0.5
        assert _tap_run(reads, strip, True, monkeypatch, took) == _tap_run(reads, strip, False, monkeypatch), reads
    assert took[0] > 1_000  # the taps passed that many reads in one piece
