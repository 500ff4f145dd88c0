"""router/fleet/_wire.c answers as upstream.py's Python code, or declines (then the Python runs):
compared on random header blocks and header mappings, and on whole answers' heads."""
from __future__ import annotations

import random

import pytest
from multidict import CIMultiDict

from router.fleet import upstream
from router.fleet.upstream import _HEADER, _HEADER_BLOCK, UpstreamProtocolError, UpstreamResponse

wire = upstream.wire
pytestmark = pytest.mark.skipif(wire is None, reason="router/fleet/_wire.c not built (or PREFIXLB_PURE_PYTHON)")

NAMES = ["Content-Type", "Content-Length", "X-Request-Id", "Date", "a", "X_y", "bad name", "", "caf\u00e9", "x\ty"]
PIECES = ["", "v", " ", "\t", "json; charset=utf-8", "12", "\r", "\n", "\r\n", ":", "\u00e9", "\x00", "\x7f", "a b",
          "\udcff"]


def _value(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 4)))


def _block(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randrange(0, 6)):
        sep = rng.choice([":", ": ", ":\t ", ":", ""])
        lines.append(rng.choice(NAMES) + sep + _value(rng) + rng.choice(["\r\n"] * 8 + ["\n", "\r", ""]))
    return "".join(lines)


def _regex_pairs(block: str) -> list[tuple[str, str]] | None:
    """What upstream.py's regexes give (None: they leave the block to the line-by-line loop)."""
    if _HEADER_BLOCK.fullmatch(block) and " \r\n" not in block and "\t\r\n" not in block:
        return _HEADER.findall(block)
    return None


def test_header_pairs_are_the_regexes_pairs_of_every_ascii_block_and_decline_the_rest() -> None:
    rng = random.Random(7)
    answered = 0
    for _ in range(40_000):
        block = _block(rng)
        pairs = wire.header_pairs(block)
        if block.isascii():
            assert pairs == _regex_pairs(block), repr(block)
            answered += pairs is not None
        else:
            assert pairs is None
    assert answered > 5_000  # the random blocks reach the compiled path often


def _python_lines(headers) -> str:
    saved, upstream.wire = upstream.wire, None
    try:
        return upstream.header_lines(headers)
    finally:
        upstream.wire = saved


def test_header_lines_are_the_python_lines_or_declined_on_random_headers() -> None:
    rng = random.Random(11)
    answered = 0
    for i in range(20_000):
        items = [(rng.choice(NAMES), rng.choice([_value(rng), _value(rng), 7, None]) if rng.random() < 0.1
                  else _value(rng)) for _ in range(rng.randrange(0, 6))]
        headers = CIMultiDict(items) if i % 2 else dict(items)
        lines = wire.header_lines(headers)
        try:
            expected: str | type = _python_lines(headers)
        except (ValueError, TypeError) as exc:  # (a None value beside a newline: the Python's TypeError)
            expected = type(exc)
        if lines is NotImplemented:
            plain = all(isinstance(x, str) and x.isascii() and "\r" not in x and "\n" not in x
                        for pair in headers.items() for x in pair)
            assert not plain, headers
        else:
            answered += 1
            assert lines == expected
    assert answered > 5_000


def test_a_header_with_a_newline_is_still_refused() -> None:
    with pytest.raises(ValueError, match="a newline in header"):
        upstream.header_lines({"X-Request-Id": "a\r\nHost: evil"})


def _parse(head: bytes, compiled: bool):
    saved = upstream.wire
    upstream.wire = saved if compiled else None
    try:
        r = UpstreamResponse.__new__(UpstreamResponse)
        r._keep_alive, r._state, r._remaining, r._head_done, r.status = True, 0, 0, False, 0
        try:
            r._head(head)
        except UpstreamProtocolError as exc:
            return "error", str(exc)
        headers = list(r.headers.items()) if r._head_done else None
        return r.status, headers, r._keep_alive, r._state, r._remaining
    finally:
        upstream.wire = saved


def test_an_answers_head_parses_alike_with_and_without_the_compiled_loop() -> None:
    rng = random.Random(3)
    statuses = ["HTTP/1.1 200 OK", "HTTP/1.0 200 OK", "HTTP/1.1 503 Service Unavailable", "HTTP/1.1 100 Continue",
                "HTTP/2 200", "HTTP/1.1 204 No Content"]
    framing = ["Content-Length: 341\r\n", "Transfer-Encoding: chunked\r\n", "Connection: close\r\n",
               "Connection: keep-alive\r\n", "Content-Length: 3\r\nContent-Length: 4\r\n", ""]
    for _ in range(10_000):
        block = _block(rng) + "".join(rng.sample(framing, rng.randrange(0, 3)))
        head = (rng.choice(statuses) + "\r\n" + block).removesuffix("\r\n").encode("utf-8", "surrogateescape")
        assert _parse(head, True) == _parse(head, False), head


class _Pair(tuple):
    """A 2-tuple that str.join reads through its own __iter__ (as the Python code does)."""

    def __iter__(self):
        return iter(("X-Other", "other"))


class _PairItems(dict):
    def items(self):  # type: ignore[override]
        return [_Pair(("X-Request-Id", "abc"))]


class _Falsy(dict):
    def __bool__(self) -> bool:
        return False


class _LongerThanItems(dict):
    def __len__(self) -> int:
        return 5


class _NoLen:
    def items(self):
        return [("X-Request-Id", "abc")]


def _outcome(call, headers):
    try:
        return call(headers)
    except Exception as exc:  # noqa: BLE001 (the kind of error is what is compared)
        return type(exc)


@pytest.mark.parametrize("headers", [[], (), "", None, _PairItems(a="b"), _Falsy({"X-A": "b"}),
                                     _LongerThanItems({"X-A": "b"}), _NoLen()],
                         ids=["empty list", "empty tuple", "empty str", "None", "tuple subclass items",
                              "falsy mapping", "len beyond items", "no len"])
def test_header_lines_of_unusual_mappings_are_the_python_answer_or_error(headers) -> None:
    """Where the compiled loop answers, it is the Python code's answer, or error of the same kind."""
    compiled = _outcome(wire.header_lines, headers)
    if compiled is not NotImplemented:
        assert compiled == _outcome(_python_lines, headers)
    assert _outcome(upstream.header_lines, headers) == _outcome(_python_lines, headers)


class _Conn:
    """What an UpstreamResponse touches of its connection while it parses."""

    transport = None
    lost = False
    loop = None  # (the parse schedules nothing)

    def close(self) -> None:
        self.lost = True


def _chunk_line(rng: random.Random, size: int) -> bytes:
    text = rng.choice([f"{size:x}", f"{size:X}", f"{size:04x}", f"{size:x};ext=1", f" {size:x}", f"{size:x} ",
                       f"+{size:x}", f"0x{size:x}", f"{size:x}" if size else "", "zz", f"1_{size:x}",
                       "1" * 17] if rng.random() < 0.15 else [f"{size:x}"])
    return text.encode()


def _chunked_body(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randrange(0, 6)):
        size = rng.choice([1, 2, 5, 17, 200, rng.randrange(1, 70_000)])
        data = bytes(rng.randrange(256) for _ in range(min(size, 64))) * (size // 64 + 1)
        end = b"\r\n" if rng.random() < 0.95 else rng.choice([b"\n", b"xx", b"\r"])
        parts.append(_chunk_line(rng, size) + b"\r\n" + data[:size] + end)
    if rng.random() < 0.9:
        parts.append(b"0\r\n" + rng.choice([b"", b"X-Trailer: 1\r\n"]) + b"\r\n" + rng.choice([b"", b"", b"extra"]))
    return b"".join(parts)


def _reads(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(0, 6)))) if len(data) > 1 else []
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


class _CountingWire:
    """``upstream.wire``, counting the reads whose chunks ``chunks`` took."""

    def __init__(self, wire) -> None:
        self.header_pairs, self.header_lines = wire.header_pairs, wire.header_lines
        self._chunks, self.took = wire.chunks, 0

    def chunks(self, data: bytes, pos: int) -> tuple[bytes, int]:
        payload, end = self._chunks(data, pos)
        self.took += end > pos
        return payload, end


async def _fed(reads: list[bytes], compiled: bool, spy: _CountingWire | None = None):
    saved = upstream.wire
    upstream.wire = (spy or saved) if compiled else None
    try:
        r = UpstreamResponse(_Conn(), None, ("h", 1), None)  # type: ignore[arg-type]
        for data in reads:
            r._feed(data)
        exc = r._exc
        return (b"".join(r._chunks), r._buffered, r._state, r._remaining, bytes(r._buf), r._keep_alive,
                None if exc is None else (type(exc), str(exc)), r._conn.lost)
    finally:
        upstream.wire = saved


def test_a_chunked_answer_parses_alike_with_and_without_the_compiled_chunks() -> None:
    """Random chunked bodies (plain chunks, extensions, odd size lines, bad chunk ends, trailers,
    bytes after the end), cut into random reads, after a head alone or with the body's start:
    the same data, state and failure either way."""
    import asyncio

    spy = _CountingWire(wire)

    async def run() -> None:
        rng = random.Random(5)
        for _ in range(3_000):
            body = _chunked_body(rng)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            reads = _reads(rng, head + body) if rng.random() < 0.5 else [head, *_reads(rng, body)]
            assert await _fed(reads, True, spy) == await _fed(reads, False), reads

    asyncio.run(run())
    assert spy.took > 500  # the compiled call took the chunks of that many reads (1,138 of this seed)


def test_chunks_takes_only_plain_whole_chunks() -> None:
    assert wire.chunks(b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n", 0) == (b"helloabc", 18)
    assert wire.chunks(b"xx5\r\nhello\r\n3\r\nab", 2) == (b"hello", 12)  # the partial chunk is left
    assert wire.chunks(b"5;x\r\nhello\r\n", 0) == (b"", 0)
    assert wire.chunks(b"A\r\n0123456789\r\n", 0) == (b"0123456789", 15)
    assert wire.chunks(b"1\r\nab\r\n", 0) == (b"", 0)  # no CRLF after the data: the parser's error
    with pytest.raises(ValueError):
        wire.chunks(b"", 1)
