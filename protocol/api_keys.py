"""Optional API keys on both servers: the router's ``/v1/*``, and every endpoint of a worker but
its probes (``/health``, ``/load``, ``/metrics``).

With ``--api-key`` set (repeatable), a guarded request must carry ``Authorization: Bearer
<key>``: missing or wrong is a 401 in OpenAI's shape, before the route is even looked up (an
unknown ``/v1/`` path or a wrong method says nothing to a client without a key). A header that
is not valid UTF-8 is a wrong key like any other (never a 500). Every configured key is
compared in constant time, whatever matched, so response timing says nothing about the keys.
The router sends workers its ``--worker-api-key``; the worker guards more than ``/v1/``
because ``/tokenize``, ``/detokenize`` and ``/health_generate`` run the tokenizer, a chat
template or the engine.
"""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable, Collection, Sequence

from aiohttp import web

from protocol.openai_errors import INVALID_REQUEST, OpenAIError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Guard = Callable[[web.Request], bool]


def bearer_token(header: str | None) -> bytes | None:
    """The token of ``Authorization: Bearer <token>`` as bytes; None when ``header`` is absent or
    names another scheme."""
    if not header:
        return None
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    # aiohttp hands undecodable bytes over as surrogates, which plain UTF-8 cannot encode.
    return given.strip().encode("utf-8", "surrogatepass")


def matches_any(token: bytes | None, keys: Sequence[str]) -> bool:
    """Whether ``token`` is one of ``keys``, comparing with every key in constant time."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token or b"", key.encode("utf-8", "surrogatepass"))
    return matched and token is not None


def check_api_key(header: str | None, keys: Sequence[str]) -> None:
    """Raise a 401 :class:`OpenAIError` unless ``header`` is ``Bearer <one of keys>`` (no keys: open)."""
    if not keys:
        return
    if not header:
        raise OpenAIError(401, "Missing API key: send 'Authorization: Bearer <key>'", INVALID_REQUEST,
                          code="missing_api_key")
    if not matches_any(bearer_token(header), keys):
        raise OpenAIError(401, "Incorrect API key provided", INVALID_REQUEST, code="invalid_api_key")


def openai_paths(request: web.Request) -> bool:
    """The router's guard: every ``/v1/`` path, known or not."""
    return request.path.startswith("/v1/")


def every_route_but(open_paths: Collection[str]) -> Guard:
    """The worker's guard: every ``/v1/`` path and every other route except ``open_paths``
    (a path that is no route at all stays a plain 404, as on the router)."""
    open_paths = frozenset(open_paths)

    def guarded(request: web.Request) -> bool:
        if request.path.startswith("/v1/"):
            return True
        return request.match_info.http_exception is None and request.path not in open_paths

    return guarded


def api_key_middleware(keys: Sequence[str], guarded: Guard = openai_paths):
    """Middleware checking :func:`check_api_key` on the requests ``guarded`` selects (goes inside
    the error middleware)."""
    keys = tuple(keys)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if guarded(request):
            check_api_key(request.headers.get("Authorization"), keys)
        return await handler(request)

    return middleware
