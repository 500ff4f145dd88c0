"""PromptKey: what routing needs from a request body -- its chain hashes, size and ring key.

The body is rendered canonically (``protocol.render``) and hashed into chunk hashes seeded by
the namespace (model, ``lora_adapter``, ``cache_salt``), exactly as the worker does for its KV
events. The **ring key** places requests with nothing cached anywhere: the session key's hash
if the request has one, else the chain hash of its first ``ring_key_chunks`` chunks (so
requests sharing a system prompt or document land together), else -- for prompts shorter than
one chunk -- a hash of the whole rendering.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import xxhash

from protocol import chunk_hashes, namespace_seed, render_request, session_hash
from router.routing.precise import PromptTokens

MAX_SESSION_KEY_CHARS = 256
DEFAULT_RING_KEY_CHUNKS = 8


@dataclass(slots=True)
class PromptKey:
    """The routing view of one request."""

    model: str
    num_bytes: int
    hashes: list[int]
    ring_key: int
    session_key: str | None = None
    chat: bool = False
    tokens: PromptTokens | None = None  # the backend tokenizer's ids, where the router has one
    known_cached: dict[str, int] | None = None  # exact cached tokens of precise backends (set by decide)
    adapter: str | None = None  # the LoRA adapter: ``lora_adapter``, or a ``model`` workers report as one
    # The key tokens-per-byte is learned under: the model, and the endpoint (read four times a
    # request: kept, not a property).
    ratio_key: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.ratio_key = self.model + " (chat)" if self.chat else self.model


def session_key_of(headers: Mapping[str, str], body: Mapping[str, Any],
                   header_names: Sequence[str], field_names: Sequence[str]) -> str | None:
    """The request's session key: the first configured header, then body field, that is set."""
    for name in header_names:
        value = headers.get(name)
        if value:
            return value[:MAX_SESSION_KEY_CHARS]
    if body.keys().isdisjoint(field_names):  # (the usual body: none of the fields)
        return None
    for name in field_names:
        value = body.get(name)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
            return str(value)[:MAX_SESSION_KEY_CHARS]
    return None


def prompt_key(body: Mapping[str, Any], chat: bool, chunk_size: int, ring_key_chunks: int,
               session_key: str | None = None) -> PromptKey:
    """Render and hash ``body`` (raises ``protocol.RenderError`` on malformed prompts)."""
    model = body.get("model")
    model = model if isinstance(model, str) else ""
    adapter = body.get("lora_adapter")
    salt = body.get("cache_salt")
    seed = namespace_seed(model, adapter if isinstance(adapter, str) else None,
                          salt if isinstance(salt, str) else None)
    data = render_request(body, chat)  # type: ignore[arg-type]
    hashes = chunk_hashes(data, chunk_size, seed)
    return PromptKey(model, len(data), hashes, ring_key_of(data, hashes, seed, ring_key_chunks, session_key),
                     session_key, chat, adapter=adapter if isinstance(adapter, str) and adapter else None)


def ring_key_of(data: bytes, hashes: Sequence[int], seed: int, ring_key_chunks: int,
                session_key: str | None) -> int:
    """The ring position of a request (see the module docstring)."""
    if session_key:
        return session_hash(session_key, seed)
    if hashes:
        return hashes[min(len(hashes), max(1, ring_key_chunks)) - 1]
    return xxhash.xxh3_64_intdigest(data, seed=seed)
