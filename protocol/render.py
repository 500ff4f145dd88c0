"""Canonical prompt rendering: the bytes the router hashes and the worker re-hashes.

Both sides must turn the same request into the same bytes, and a request that extends another
(one more chat turn, a longer prompt) must render to bytes that *start with* the shorter one's
rendering, so that its chunk-hash chain extends the shorter chain.

Layout of a rendered chat request (``\\x1e`` separates a header from its payload, ``\\x1d``
ends a segment; neither appears in JSON, and real text almost never contains them)::

    tools\\x1e<tools as compact JSON, sorted keys>\\x1d          (only when tools are given)
    <role>[:<name>]\\x1e<content><tool calls as JSON>\\x1d       (one per message, in order)

Messages are rendered in the order the chat template sees them, every message counts, and
system messages are rendered where they stand (normally first). Content parts: text parts are
concatenated, other parts (images, audio, files) become a deterministic JSON of the part with
inline data (``data:`` URLs, base64 payloads) replaced by a digest, so two requests with the
same image share a prefix and a huge inline image does not make huge index keys.

A completion renders to the prompt text's UTF-8 bytes, or, for a token-id prompt, to
``tokens\\x1e`` followed by the ids as little-endian uint32.
"""
from __future__ import annotations

import json
import struct
from typing import Any

import xxhash

SEP = b"\x1e"
END = b"\x1d"

class RenderError(ValueError):
    """The request cannot be rendered (wrong shapes); the HTTP edge maps this to a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def canonical_json(value: Any) -> bytes:
    """Deterministic compact JSON: sorted keys, no whitespace, UTF-8 kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


def _digest_inline_data(value: Any) -> Any:
    """Replace inline payloads (data URLs, long base64 strings) by a short stable digest."""
    if isinstance(value, dict):
        return {k: _digest_inline_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_digest_inline_data(v) for v in value]
    if isinstance(value, str) and (value.startswith("data:") or len(value) > 1024):
        return "sha:" + xxhash.xxh3_128_hexdigest(value.encode("utf-8", "surrogatepass"))
    return value


def render_content(content: Any, param: str = "content") -> bytes:
    """Render a message's ``content``: a string, ``None``, or a list of content parts."""
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode("utf-8", "surrogatepass")
    if isinstance(content, list):
        out = bytearray()
        for i, part in enumerate(content):
            if isinstance(part, str):
                out += part.encode("utf-8", "surrogatepass")
                continue
            if not isinstance(part, dict):
                raise RenderError("content parts must be objects", f"{param}[{i}]")
            if part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                out += part["text"].encode("utf-8", "surrogatepass")
            else:
                out += b"\x1f" + canonical_json(_digest_inline_data(part)) + b"\x1f"
        return bytes(out)
    raise RenderError("content must be a string, null or a list of parts", param)


def render_message(message: Any, index: int = 0) -> bytes:
    """Render one chat message into its canonical segment."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RenderError("each message must be an object", param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise RenderError("each message needs a string 'role'", f"{param}.role")
    header = role.encode("utf-8", "surrogatepass")
    name = message.get("name")
    if isinstance(name, str) and name:
        header += b":" + name.encode("utf-8", "surrogatepass")
    body = render_content(message.get("content"), f"{param}.content")
    if message.get("tool_calls") is not None:
        body += SEP + canonical_json(message["tool_calls"])
    if message.get("tool_call_id") is not None:
        body += SEP + canonical_json(message["tool_call_id"])
    return header + SEP + body + END


def render_chat(messages: Any, tools: Any = None) -> bytes:
    """Render a chat request: tools first (as the template places them), then every message."""
    if not isinstance(messages, list):
        raise RenderError("'messages' must be a list", "messages")
    out = bytearray()
    if tools:
        out += b"tools" + SEP + canonical_json(_digest_inline_data(tools)) + END
    for i, message in enumerate(messages):
        out += render_message(message, i)
    return bytes(out)


def render_completion(prompt: Any) -> bytes:
    """Render a completion prompt: text, or a list of token ids (a single prompt only)."""
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return render_completion(prompt[0])
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            return b"tokens" + SEP + struct.pack(f"<{len(prompt)}I", *prompt)
        except struct.error as exc:
            raise RenderError("token ids must be in [0, 2**32)", "prompt") from exc
    raise RenderError("'prompt' must be a string or a list of token ids", "prompt")


def render_request(body: dict, chat: bool) -> bytes:
    """Render an OpenAI request body (``/v1/chat/completions`` when ``chat``, else completions)."""
    if chat:
        return render_chat(body.get("messages"), body.get("tools"))
    return render_completion(body.get("prompt"))
