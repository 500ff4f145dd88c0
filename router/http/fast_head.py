"""Which request heads the router's fast front (``router/http/front.py``) reads itself, and what it
reads of them: :func:`parse_head` says, strictly (anything unusual is aiohttp's to judge), and
:class:`HeadShapes` remembers the answer for the heads a client sends again and again.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from multidict import CIMultiDict, CIMultiDictProxy

from router.fleet.upstream import HTTP_TOKEN

MAX_FAST_BODY = 1 << 20  # larger bodies go to aiohttp, which checks them as they arrive
MAX_FAST_HEADERS = 64  # more header lines go to aiohttp (which refuses more than 128)
HEADER_BLOCK = re.compile(rf"(?:{HTTP_TOKEN}:[\t\x20-\x7e]*\r\n)*")  # the head after its request line
HEADER = re.compile(rf"({HTTP_TOKEN}):[\t ]*([^\r]*)\r\n")  # (name, value) of each line (no trailing blank)
CONTENT_LENGTH = re.compile(r"\r\ncontent-length:[\t ]*([^\r]*)")
# headers whose requests aiohttp handles itself (decompressing a body, refusing a WebSocket key1)
HANDED_OVER = re.compile(r"\r\n(?:transfer-encoding|expect|upgrade|content-encoding|sec-websocket-key1):")
# headers aiohttp's parser refuses to see twice (a 400): a repeat is aiohttp's to answer
ONCE = re.compile(r"\r\n(content-type|user-agent|server|etag|max-forwards|content-location|content-range):"
                  r"(?:[^\r]*\r\n)*?\1:")
CONNECTION = re.compile(r"\r\nconnection:([^\r]*)(?=\r\n)")


def parse_head(head: bytes, paths: Mapping[str, Any]) -> tuple[str, CIMultiDictProxy, int, bool] | None:
    """``(path, headers, content_length, keep_alive)`` of a request head the fast path serves
    (``POST`` of one of ``paths``), or None (aiohttp's). Strict: anything unusual is aiohttp's to
    judge. Each check is one scan in C (this runs for every request)."""
    parts = head_parts(head, paths)
    return None if parts is None else (parts[0], CIMultiDictProxy(CIMultiDict(parts[1])), parts[2], parts[3])


def head_parts(head: bytes, paths: Mapping[str, Any]) -> tuple[str, list[tuple[str, str]], int, bool] | None:
    """:func:`parse_head`, with the headers as their (name, value) pairs."""
    if not head.isascii():
        return None
    text = head.decode("ascii")
    end = text.find("\r\n")
    if end < 0 or not text.startswith("POST ") or not text.endswith(" HTTP/1.1", 0, end):
        return None
    path = text[5:end - 9]
    if path not in paths:
        return None
    block = text[end + 2:] + "\r\n"
    if block.count("\n") > MAX_FAST_HEADERS or not HEADER_BLOCK.fullmatch(block):
        return None  # control characters, obs-fold, a name that is no token
    if " \r\n" in block or "\t\r\n" in block:
        return None  # a value with trailing blanks (aiohttp trims them)
    lower = "\r\n" + block.lower()
    if HANDED_OVER.search(lower) or lower.count("\r\nhost:") != 1 or ONCE.search(lower):
        return None  # aiohttp's: framing and encodings it handles, a Host missing or repeated
    lengths = CONTENT_LENGTH.findall(lower)
    if len(lengths) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 12:
        return None
    length = int(lengths[0])
    if length > MAX_FAST_BODY:
        return None
    keep_alive = True
    if "\r\nconnection:" in lower:
        tokens = {t.strip() for value in CONNECTION.findall(lower) for t in value.split(",")}
        if "upgrade" in tokens:
            return None
        keep_alive = "close" not in tokens
    return path, HEADER.findall(block), length, keep_alive


class HeadShapes:
    """:func:`parse_head` of the heads a client sends again and again, remembered by their shape:
    the head less the digits of its ``Content-Length: `` line, which is all that changes from one
    request of a client to the next. The digits are the only input of the parse that differs
    between two heads of a shape, and they are digits in both, so a shape parsed once (and found
    fast) is fast again: only the length's own checks are repeated, and the headers rebuilt with
    it. The same answer as :func:`parse_head` (9.7 -> 2.7 us a head); a head of another form is
    parsed in full."""

    SIZE = 256  # shapes remembered (then forgotten all at once: a client sending ever new heads pays the parse)

    def __init__(self, paths: Mapping[str, Any]) -> None:
        self.paths = paths
        self._shapes: dict[bytes, tuple[str, list[tuple[str, str]], int, bool]] = {}

    def parse(self, head: bytes) -> tuple[str, CIMultiDictProxy, int, bool] | None:
        at = head.find(b"\r\nContent-Length: ")
        if at < 0:
            return parse_head(head, self.paths)
        start = at + 18
        end = head.find(b"\r\n", start)
        if end < 0:
            end = len(head)
        digits = head[start:end]
        if not digits.isdigit():
            return parse_head(head, self.paths)
        key = head[:start] + head[end:]  # (the length's line is where it was: the bytes before it are kept)
        shape = self._shapes.get(key)
        if shape is None:
            parts = head_parts(head, self.paths)
            if parts is None:  # (not remembered: the digits may be why)
                return None
            if len(self._shapes) >= self.SIZE:
                self._shapes.clear()
            # the length's line among the headers: the request line is the head's first
            shape = self._shapes[key] = (parts[0], parts[1], head.count(b"\r\n", 0, at), parts[3])
            return parts[0], CIMultiDictProxy(CIMultiDict(parts[1])), parts[2], parts[3]
        if len(digits) > 12 or int(digits) > MAX_FAST_BODY:  # head_parts' checks of the length
            return None
        path, pairs, index, keep_alive = shape
        pairs = pairs.copy()
        pairs[index] = (pairs[index][0], digits.decode("ascii"))
        return path, CIMultiDictProxy(CIMultiDict(pairs)), int(digits), keep_alive
