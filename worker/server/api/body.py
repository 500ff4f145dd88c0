"""Reading request bodies within limits: size (413), time (408), then protocol validation."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from protocol.openai_api import RequestLimits, parse_json_body
from protocol.openai_body import decode_off_loop, read_limited_body

BODY_READ_TIMEOUT_S = 30.0


async def read_body(request: web.Request, limits: RequestLimits,
                    timeout: float = BODY_READ_TIMEOUT_S) -> bytearray:
    """The raw body, refused early when too large or over its JSON structure budget (checked as
    it arrives) and bounded in time against slow clients."""
    return await read_limited_body(request.content_length, request.content, limits.max_body_bytes, timeout, limits)


async def read_json(request: web.Request, limits: RequestLimits,
                    timeout: float = BODY_READ_TIMEOUT_S) -> dict[str, Any]:
    """The body as a validated JSON object (see protocol.openai_api.parse_json_body); a large
    one is decoded off the event loop."""
    return await decode_off_loop(await read_body(request, limits, timeout), parse_json_body, limits)
