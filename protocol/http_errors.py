"""The one place failures become HTTP answers, in OpenAI's error shape, for router and worker alike.

Two doors lead here:

- :func:`error_middleware`: whatever a handler raises. An :class:`OpenAIError` carries its own
  status; aiohttp's routing errors are re-shaped (an unknown path is a 404 ``not_found_error``,
  like every other 404 of ours; a wrong method a 405 with the ``Allow`` header HTTP requires);
  each server maps its own exceptions with ``map_exception`` (the worker: engine refusals, a dead
  engine); anything else is a bug, logged with its traceback and answered 500 ``server_error``
  without details, and the server keeps serving.
- :class:`OpenAIErrorServer`: malformed HTTP (oversized or too many headers, bad framing), which
  aiohttp answers with plain text before any handler or middleware runs. Both servers run their
  app with :func:`app_runner`, which swaps the ``web.Server``'s class for it so that clients get
  a JSON 4xx like every other error.
"""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Awaitable, Callable, Mapping

from aiohttp import web

from protocol.openai_errors import INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, OpenAIError, error_body

log = logging.getLogger("prefixlb.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ExceptionMapper = Callable[[Exception], "OpenAIError | None"]


def openai_error(exc: Exception, map_exception: ExceptionMapper | None = None) -> OpenAIError:
    """The OpenAI error a client gets for ``exc`` (see the module docstring for the order)."""
    if isinstance(exc, OpenAIError):
        return exc
    if map_exception is not None:
        mapped = map_exception(exc)
        if mapped is not None:
            return mapped
    if isinstance(exc, web.HTTPException):
        kind = NOT_FOUND if exc.status == 404 else SERVER_ERROR if exc.status >= 500 else INVALID_REQUEST
        return OpenAIError(exc.status, exc.reason, kind)
    return OpenAIError(500, "Internal server error", SERVER_ERROR)


def error_middleware(map_exception: ExceptionMapper | None = None, *,
                     on_error: Callable[[int], None] | None = None,
                     headers: Mapping[str, str] | None = None, retry_after_s: int | None = None,
                     on_response: Callable[[web.Request, int], None] | None = None):
    """Middleware answering every exception a handler raises with an OpenAI-shaped JSON error.

    ``map_exception`` maps the server's own exceptions (None: not one of them); ``on_error`` is
    told the status of every error answered, ``on_response`` that of every answer (success or
    error; one middleware layer less than a counting middleware of its own); ``headers`` go on
    every response not yet sent (success or error; the worker names itself); ``retry_after_s``
    adds ``Retry-After`` to 429 and 503 errors. Redirects (``web.HTTPException`` below 400) pass through untouched.
    """
    always = dict(headers or {})

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except Exception as exc:  # noqa: BLE001 - this is the one mapping point
            if isinstance(exc, web.HTTPException) and exc.status < 400:
                raise
            err = openai_error(exc, map_exception)
            if err.status == 500 and not isinstance(exc, (OpenAIError, web.HTTPException)):
                log.exception("event=handler_crashed path=%s status=%d", request.path, err.status)
            if on_error is not None:
                on_error(err.status)
            response = web.json_response(err.body(), status=err.status)
            if isinstance(exc, web.HTTPMethodNotAllowed):
                response.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
            if retry_after_s is not None and err.status in (429, 503):
                response.headers["Retry-After"] = str(retry_after_s)
        if always and not response.prepared:
            response.headers.update(always)
        if on_response is not None:
            on_response(request, response.status)
        return response

    return middleware


class OpenAIErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering malformed HTTP with an OpenAI-shaped JSON 4xx,
    logged at debug level only: the client is at fault, and a flood of them must not flood the log."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        log.debug("event=malformed_http status=%d error=%r", status, str(exc)[:200])
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response")
        detail = " ".join((message or "").split())[:300] or HTTPStatus(status).phrase
        response = web.json_response(error_body(f"Malformed HTTP request: {detail}", INVALID_REQUEST,
                                                None, "malformed_request"), status=status)
        response.force_close()
        return response


class OpenAIErrorServer(web.Server):
    """A ``web.Server`` whose connections use :class:`OpenAIErrorRequestHandler`."""

    def __call__(self) -> web.RequestHandler:
        return OpenAIErrorRequestHandler(self, loop=self._loop, **self._kwargs)


async def app_runner(app: web.Application) -> web.AppRunner:
    """``app``'s runner, set up as both servers run: a client that disconnects cancels its
    handler (which aborts its work), no access log (the servers log events), and malformed HTTP
    answered by :class:`OpenAIErrorServer`."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    assert type(runner.server) is web.Server
    runner.server.__class__ = OpenAIErrorServer  # only changes which handler class it builds
    return runner
