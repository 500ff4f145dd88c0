"""Reading request bodies within limits: size (413), time (408), then protocol validation."""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from protocol.openai_api import OpenAIError, RequestLimits, body_too_large, parse_json_body

BODY_READ_TIMEOUT_S = 30.0


async def read_body(request: web.Request, limits: RequestLimits,
                    timeout: float = BODY_READ_TIMEOUT_S) -> bytes:
    """The raw body, refused early when too large and bounded in time against slow clients."""
    limit = limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)

    async def _read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(_read(), timeout)
    except asyncio.TimeoutError:
        raise OpenAIError(408, f"Request body not received within {timeout:.0f} s", code="timeout") from None


async def read_json(request: web.Request, limits: RequestLimits,
                    timeout: float = BODY_READ_TIMEOUT_S) -> dict[str, Any]:
    """The body as a validated JSON object (see protocol.openai_api.parse_json_body)."""
    return parse_json_body(await read_body(request, limits, timeout), limits)
