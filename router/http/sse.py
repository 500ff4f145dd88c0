"""UsageTap: pass a worker's SSE stream through event by event, catching its ``usage``.

The router always asks a streaming worker for usage (``stream_options.include_usage``) because
``usage.prompt_tokens_details.cached_tokens`` is its feedback signal. When the client did not
ask for usage itself, the tap removes it again: the usage-only chunk (``choices: []``) is
dropped, and a ``usage`` field riding on a normal chunk is deleted -- so the client sees exactly
the stream it asked for.

Events are forwarded as soon as they are complete (an SSE event ends with a blank line); only an
incomplete tail is held back, and workers write whole events, so in practice nothing waits.
"""
from __future__ import annotations

import json
from typing import Any

from protocol import untrusted_json

MAX_EVENT_BYTES = 8 << 20  # one SSE event larger than this is not an answer: the stream is refused


class EventTooLarge(ValueError):
    """The worker sent more than ``MAX_EVENT_BYTES`` without ending an SSE event."""


def _split_events(buffer: bytes, scan_from: int = 0) -> tuple[list[bytes], bytes]:
    """Complete events (each with its terminating blank line) and the incomplete rest; the first
    separator is searched for from ``scan_from`` on (the part before was scanned already).

    Each separator's next place is kept until an event ends past it, so the buffer is scanned
    once whatever the number of events in it (a read that holds many token events would
    otherwise be rescanned to its end for a separator it does not hold, once an event)."""
    events: list[bytes] = []
    start = 0
    lf = buffer.find(b"\n\n", scan_from)
    crlf = buffer.find(b"\r\n\r\n", scan_from)
    while lf >= 0 or crlf >= 0:
        if crlf < 0 or 0 <= lf < crlf:
            end = lf + 2
        else:
            end = crlf + 4
        events.append(buffer[start:end])
        start = end
        if 0 <= lf < start:
            lf = buffer.find(b"\n\n", start)
        if 0 <= crlf < start:
            crlf = buffer.find(b"\r\n\r\n", start)
    return events, buffer[start:]


def _data_json(event: bytes) -> Any:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            try:
                return untrusted_json.loads(payload)
            except ValueError:
                return None
    return None


def _is_done(event: bytes) -> bool:
    return any(line.startswith(b"data:") and line[5:].strip() == b"[DONE]" for line in event.splitlines())


def _plain_events(buffer: bytes) -> tuple[int, int] | None:
    """``(end, count)`` when ``buffer[:end]`` is ``count`` complete events that :meth:`UsageTap.feed`
    forwards as they are and ``buffer[end:]`` the tail it keeps, found with a few scans in C
    instead of an event at a time: no ``\\r`` (the only separator is a blank line ``\\n\\n``), no
    ``[DONE]``, every ``"usage"`` a ``"usage":null`` (or ``"usage": null``), and the last
    separator not in a longer run of newlines (whose pairing decides where the tail starts). None
    otherwise: no complete event, or one of those to look at event by event."""
    last = buffer.rfind(b"\n\n")
    if last < 0 or (last and buffer[last - 1] == 0x0A) or b"\r" in buffer or b"[DONE]" in buffer:
        return None
    usage = buffer.count(b'"usage"')
    if usage and usage != buffer.count(b'"usage":null') + buffer.count(b'"usage": null'):
        return None
    return last + 2, buffer.count(b"\n\n")


def strip_usage(body: dict[str, Any]) -> None:
    """Remove ``usage`` from a non-streaming response body the client did not ask usage from."""
    body.pop("usage", None)


class UsageTap:
    """Feed upstream bytes in, get the bytes to forward out; ``usage`` holds the last usage seen."""

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: dict[str, Any] | None = None
        self.events = 0
        self.done = False  # saw ``data: [DONE]``: the upstream ended its stream properly
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client now (complete events only, usage removed if stripping)."""
        held = len(self._tail)
        buffer = self._tail + chunk if held else chunk
        if not self.done:
            passed = _plain_events(buffer)
            if passed:
                end, count = passed
                self._tail = buffer[end:]
                if len(self._tail) > MAX_EVENT_BYTES:
                    raise EventTooLarge(f"an SSE event of more than {MAX_EVENT_BYTES} bytes")
                self.events += count
                return buffer if end == len(buffer) else buffer[:end]
        # a separator can straddle the old tail and the new chunk: rescan only its last 3 bytes
        events, self._tail = _split_events(buffer, max(0, held - 3))
        if len(self._tail) > MAX_EVENT_BYTES:
            raise EventTooLarge(f"an SSE event of more than {MAX_EVENT_BYTES} bytes")
        if not events or self.done:
            return b""
        out = []
        for event in events:
            if self.done:  # the stream ended at [DONE]: what a worker sends after it is dropped
                break
            self.events += 1
            if b"[DONE]" in event and _is_done(event):
                self.done = True
            if b'"usage"' not in event or b'"usage":null' in event or b'"usage": null' in event:
                # Token chunks carry no usage (or ``"usage": null`` in every chunk, as the worker
                # and vLLM send with include_usage): forwarded without decoding. A quoted key can
                # only be a key -- JSON strings escape their quotes -- and an object has one.
                out.append(event)
                continue
            obj = _data_json(event)
            usage = obj.get("usage") if isinstance(obj, dict) else None
            if not isinstance(usage, dict):
                out.append(event)
                continue
            self.usage = usage
            if not self.strip:
                out.append(event)
            elif obj.get("choices"):
                del obj["usage"]
                out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
            # else: the usage-only chunk the client never asked for is dropped
        return b"".join(out)

    def flush(self) -> bytes:
        """Whatever incomplete tail is left when the upstream ends (forwarded as is, unless after
        ``data: [DONE]``)."""
        tail, self._tail = self._tail, b""
        return b"" if self.done else tail


def usage_numbers(usage: dict[str, Any] | None) -> tuple[int, int | None] | None:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI ``usage`` object.

    None without ``prompt_tokens``; ``cached_tokens`` is None when the backend does not report
    it (then there is nothing to check a prediction against).
    """
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(prompt, int) or isinstance(prompt, bool):
        return None
    if not isinstance(cached, int) or isinstance(cached, bool):
        cached = None
    return prompt, cached
