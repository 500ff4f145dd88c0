"""The one place exceptions become HTTP answers, and every answer gets the worker's name.

Specific exceptions map to OpenAI-shaped errors: validation (:class:`OpenAIError`, already
carrying its status), engine refusals (400), LoRA adapters (not found 404; invalid, conflicting
or disabled 400; unreadable since loading 503), a dead engine loop (503), aiohttp's own routing
errors (404 / 405, re-shaped). Anything else is a bug: logged with its traceback and answered
500 ``server_error`` without details, and the server keeps serving.
"""
from __future__ import annotations

import logging

from aiohttp import web

from protocol.openai_api import (INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, SERVICE_UNAVAILABLE,
                                 OpenAIError)
from worker.engine.errors import (EngineDeadError, EngineStepError, InvalidLoRAAdapterError, InvalidRequestError,
                                  LoRAAdapterConflictError, LoRAAdapterNotFoundError, LoRADisabledError,
                                  LoRAUnavailableError)

log = logging.getLogger("prefixlb.worker.server")
WORKER_HEADER = "X-Prefixlb-Worker-Id"


def map_exception(exc: BaseException) -> tuple[int, OpenAIError]:
    """The HTTP status and OpenAI error for ``exc``."""
    if isinstance(exc, OpenAIError):
        return exc.status, exc
    if isinstance(exc, InvalidRequestError):
        return 400, OpenAIError(400, str(exc), INVALID_REQUEST)
    for kind, status, type_, code in _LORA_ERRORS:
        if isinstance(exc, kind):
            return status, OpenAIError(status, str(exc), type_, code=code)
    if isinstance(exc, EngineDeadError):
        return 503, OpenAIError(503, "The engine has stopped; this worker cannot serve", SERVICE_UNAVAILABLE,
                                code="engine_dead")
    if isinstance(exc, EngineStepError):
        return 500, OpenAIError(500, "The engine failed while computing this request", SERVER_ERROR,
                                code="engine_step_failed")
    if isinstance(exc, ConnectionResetError):
        # The client went away while we read its request (e.g. a router gave up on this worker
        # while it was stopped): nobody will read the answer, and it is not a server error.
        return 400, OpenAIError(400, "The client closed the connection", INVALID_REQUEST,
                                code="client_disconnected")
    if isinstance(exc, web.HTTPException):
        kind = NOT_FOUND if exc.status == 404 else INVALID_REQUEST
        return exc.status, OpenAIError(exc.status, exc.reason, kind)
    return 500, OpenAIError(500, "Internal server error", SERVER_ERROR)


_LORA_ERRORS = (
    (LoRAAdapterNotFoundError, 404, NOT_FOUND, "lora_adapter_not_found"),
    (InvalidLoRAAdapterError, 400, INVALID_REQUEST, "invalid_lora_adapter"),
    (LoRAAdapterConflictError, 400, INVALID_REQUEST, "lora_adapter_conflict"),
    (LoRADisabledError, 400, INVALID_REQUEST, "lora_disabled"),
    (LoRAUnavailableError, 503, SERVICE_UNAVAILABLE, "lora_adapter_unavailable"),
)


def error_middleware(worker_id: str, on_error=None):
    """Middleware: map exceptions (see module docstring), name the worker on every response."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except Exception as exc:  # noqa: BLE001 - this is the one mapping point
            status, err = map_exception(exc)
            if status >= 500 and not isinstance(exc, (OpenAIError, EngineDeadError, LoRAUnavailableError)):
                log.exception("event=request_failed path=%s status=%d", request.path, status)
            if on_error is not None:
                on_error(status)
            resp = web.json_response(err.body(), status=status)
            if isinstance(exc, web.HTTPMethodNotAllowed):
                resp.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
        if not resp.prepared:
            resp.headers[WORKER_HEADER] = worker_id
        return resp

    return middleware
