"""``router/http/fast_head.py``'s ``HeadShapes``: a head parsed by its remembered shape gets exactly
``parse_head``'s answer -- the same path, headers in the same order, length and keep-alive, or
the same refusal -- whatever its ``Content-Length`` digits (too many, too large, zero-padded)."""
from __future__ import annotations

import random

from router.http.fast_head import MAX_FAST_BODY, HeadShapes, parse_head

PATHS = {"/v1/completions": 1, "/v1/chat/completions": 2}
USUAL = ["Content-Type: application/json", "User-Agent: a", "Accept: */*", "X-Request-Id: abc",
         "Authorization: Bearer k", "Connection: keep-alive", "Connection: close", "X-Empty:", "Accept-Encoding: gzip"]
# each makes a head aiohttp's (a second length, a second Host, framing, a repeat it refuses, a trailing blank)
UNUSUAL = ["Content-Length: 9", "content-length: 9", "Host: again", "Transfer-Encoding: chunked",
           "Content-Type: dup", "X-T: v\t"]
DIGITS = [b"0", b"1", b"77", b"0001", str(MAX_FAST_BODY).encode(), str(MAX_FAST_BODY + 1).encode(),
          b"999999999999", b"1234567890123"]


def _heads(rng: random.Random, n: int) -> list[bytes]:
    heads = []
    for _ in range(n):
        lines = rng.sample(USUAL, rng.randint(0, 6)) + (["Host: r"] if rng.random() < 0.95 else [])
        if rng.random() < 0.2:
            lines.append(rng.choice(UNUSUAL))
        rng.shuffle(lines)
        lines.insert(rng.randint(0, len(lines)), "Content-Length: 12")
        heads.append("\r\n".join([rng.choice(["POST /v1/completions HTTP/1.1", "POST /v1/chat/completions HTTP/1.1",
                                              "POST /v1/models HTTP/1.1"]), *lines]).encode())
    return heads


def _with_length(head: bytes, digits: bytes) -> bytes:
    start = head.index(b"Content-Length: 12") + 16
    return head[:start] + digits + head[start + 2:]


def _plain(parsed: tuple | None) -> tuple | None:
    return None if parsed is None else (parsed[0], list(parsed[1].items()), parsed[2], parsed[3])


def test_a_head_parsed_by_its_shape_getsparse_head_s_answer_whatever_its_length():
    rng = random.Random(18)
    shapes = HeadShapes(PATHS)
    fast = 0
    for head in rng.choices(_heads(rng, 200), k=20_000):
        head = _with_length(head, rng.choice(DIGITS))
        expected = parse_head(head, PATHS)
        assert _plain(shapes.parse(head)) == _plain(expected), head
        fast += expected is not None
    assert fast > 5_000  # most were served from a shape (not only refusals compared)


def test_a_head_whose_length_is_spelt_otherwise_is_parsed_in_full():
    shapes = HeadShapes(PATHS)
    for length in (b"Content-Length:  5", b"content-length: 5", b"Content-Length: 5 ", b"Content-Length: +5"):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n" + length
        assert _plain(shapes.parse(head)) == _plain(parse_head(head, PATHS))
