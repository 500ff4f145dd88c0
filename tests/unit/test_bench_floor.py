"""``bench/peers/floor.py``'s framing: where an answer ends, however its bytes are split."""
from __future__ import annotations

import random

import pytest

from bench.peers.floor import _Answer, _content_length


def _chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def _feed_split(answer: _Answer, body: bytes, rng: random.Random) -> int:
    """Feed ``body`` in random pieces; how many of its bytes the answer took."""
    used, at = 0, 0
    while at < len(body) and not answer.done:
        piece = body[at:at + rng.randint(1, 9)]
        used += answer.feed(piece)
        at += len(piece)
    return used


@pytest.mark.parametrize("seed", range(40))
def test_a_chunked_answer_ends_after_its_last_chunk_whatever_the_split(seed):
    rng = random.Random(seed)
    events = [b"data: " + bytes(rng.choice(b"abc\r\n{}") for _ in range(rng.randint(0, 40))) + b"\n\n"
              for _ in range(rng.randint(0, 6))]
    body = _chunked(events)
    answer = _Answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")

    used = _feed_split(answer, body + b"HTTP/1.1 200 OK\r\n", rng)

    assert answer.done and used == len(body)


def test_a_content_length_answer_ends_after_its_bytes_and_an_empty_one_at_once():
    rng = random.Random(1)
    answer = _Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n")
    assert _feed_split(answer, b"hello world" + b"extra", rng) == 11 and answer.done
    assert _Answer(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n").done


def test_content_length_is_read_from_any_header_line():
    assert _content_length(b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 42\r\n") == 42
    assert _content_length(b"GET / HTTP/1.1\r\nHost: x\r\n") is None
