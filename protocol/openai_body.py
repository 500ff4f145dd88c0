"""Decoding a request body within limits: size (413), UTF-8, JSON, nesting depth, surrogates."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from protocol.openai_errors import OpenAIError, bad_request, body_too_large


class BodyStream(Protocol):
    """What a request body is read from (aiohttp's ``StreamReader``)."""

    def iter_chunked(self, n: int) -> AsyncIterator[bytes]: ...


async def read_limited_body(content_length: int | None, content: BodyStream, limit: int,
                            timeout: float) -> bytes:
    """The raw body: a 413 as soon as it is (or is declared) over ``limit`` bytes, a 408 when it
    has not all arrived within ``timeout`` seconds (slow clients cannot hold a handler)."""
    if content_length is not None and content_length > limit:
        raise body_too_large(limit)

    async def _read() -> bytes:
        chunks, size = [], 0
        async for chunk in content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(_read(), timeout)
    except asyncio.TimeoutError:
        raise OpenAIError(408, f"Request body not received within {timeout:g} s", code="timeout") from None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what one request may contain (defaults fit 1M-token prompts, nothing absurd)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_depth: int = 32
    max_prompt_chars: int = 8 * 1024 * 1024
    max_name_chars: int = 256
    max_messages: int = 4096
    max_content_parts: int = 512
    max_prompt_token_ids: int = 1_048_576
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 256
    max_tokens: int = 1_048_576
    max_n: int = 8
    max_logprobs: int = 20
    max_tools: int = 256


DEFAULT_LIMITS = RequestLimits()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes, limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise a 4xx :class:`OpenAIError`.

    413 over ``max_body_bytes``; 400 for invalid UTF-8, malformed JSON, ``NaN``/``Infinity``,
    nesting deeper than ``max_depth``, lone surrogates, or a top level that is not an object.
    """
    if len(raw) > limits.max_body_bytes:
        raise body_too_large(limits.max_body_bytes)
    if not raw.strip():
        raise bad_request("Request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"Request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"JSON nesting is deeper than {limits.max_depth} levels") from None
    except ValueError as exc:  # json.JSONDecodeError and rejected constants
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    _check_tree(body, limits.max_depth)
    return body


def _check_tree(root: Any, max_depth: int) -> None:
    """Iteratively bound the depth and refuse strings that cannot be encoded (lone surrogates)."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("Request contains an invalid unicode string (lone surrogate)") from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise bad_request(f"JSON nesting is deeper than {max_depth} levels")
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict):
            stack.extend((k, depth) for k in value)
        stack.extend((child, depth + 1) for child in children)
