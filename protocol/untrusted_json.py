"""JSON from outside the process (a worker's answer, a Redis message, a judge's verdict, a client's
tool-call arguments): ``json.loads`` whose every failure is a ``ValueError``.

``json.loads`` raises ``RecursionError``, not ``ValueError``, for arrays or objects nested past the
interpreter's recursion limit (``[`` × 100,000 is 100 KB), and code that catches ``ValueError``
for "not JSON" lets it through: a worker could turn its answer into the router's 500, a message
on Redis could end a read of other workers' messages. Request bodies have their own, stricter
check (``protocol/openai_body.py``: a depth limit with its own 400).
"""
from __future__ import annotations

import json
from typing import Any


_DECODER = json.JSONDecoder()


def scan_whole(decoder: json.JSONDecoder, text: str) -> Any:
    """``decoder.decode(text)``. An object with no whitespace around it is scanned by the
    decoder's C scanner alone (2.7 -> 1.0 us a small request body): ``decode`` adds only
    skipping that whitespace and the check that nothing follows. Anything else, or a scan that
    stops short, is decoded by ``decode`` (its answer, its error)."""
    if text[:1] == "{" and text[-1:] == "}":
        try:
            obj, end = decoder.scan_once(text, 0)
        except StopIteration:
            return decoder.decode(text)
        if end == len(text):
            return obj
    return decoder.decode(text)


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``; JSON nested too deeply to parse raises :class:`json.JSONDecodeError`
    (a ``ValueError``), as malformed JSON does."""
    try:
        if len(data) >= 2 and data[0] == 0x7B and data[1]:  # bytes of an object: UTF-8, as json.loads' detect_encoding
            return scan_whole(_DECODER, data.decode("utf-8", "surrogatepass"))  # type: ignore[union-attr]
        return json.loads(data)
    except RecursionError:
        raise json.JSONDecodeError("JSON nested too deeply to parse", "", 0) from None
