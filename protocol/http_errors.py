"""Malformed HTTP (oversized or too many headers, bad framing) answered in OpenAI's error shape.

aiohttp answers what it cannot parse with plain text before any handler or middleware runs;
router and worker both swap their ``web.Server``'s class for :class:`OpenAIErrorServer`
(``runner.server.__class__ = OpenAIErrorServer`` after ``runner.setup()``) so that clients get
a JSON 4xx like every other error.
"""
from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web

from protocol.openai_errors import INVALID_REQUEST, error_body

log = logging.getLogger("prefixlb.http")


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
