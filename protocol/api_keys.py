"""Optional API keys on the OpenAI endpoints (``/v1/*``) of both servers; probes and metrics stay open.

With ``--api-key`` set (repeatable), every ``/v1/`` request must carry ``Authorization: Bearer
<key>``: missing or wrong is a 401 in OpenAI's shape, before the route is even looked up (an
unknown ``/v1/`` path or a wrong method says nothing to a client without a key). Every
configured key is compared in constant time, whatever matched, so response timing says nothing
about the keys. The router sends workers its ``--worker-api-key``.
"""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable, Sequence

from aiohttp import web

from protocol.openai_errors import INVALID_REQUEST, OpenAIError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def check_api_key(header: str | None, keys: Sequence[str]) -> None:
    """Raise a 401 :class:`OpenAIError` unless ``header`` is ``Bearer <one of keys>`` (no keys: open)."""
    if not keys:
        return
    if not header:
        raise OpenAIError(401, "Missing API key: send 'Authorization: Bearer <key>'", INVALID_REQUEST,
                          code="missing_api_key")
    scheme, _, given = header.partition(" ")
    candidate = given.strip().encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, key.encode("utf-8"))
    if scheme.lower() != "bearer" or not matched:
        raise OpenAIError(401, "Incorrect API key provided", INVALID_REQUEST, code="invalid_api_key")


def api_key_middleware(keys: Sequence[str]):
    """Middleware guarding ``/v1/*`` with :func:`check_api_key` (goes inside the error middleware)."""
    keys = tuple(keys)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            check_api_key(request.headers.get("Authorization"), keys)
        return await handler(request)

    return middleware
