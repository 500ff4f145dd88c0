"""The worker's own exceptions in OpenAI's shape, and its error middleware (which names the worker).

The mapping and the middleware are ``protocol/http_errors.py``'s, shared with the router; this
module adds what only the worker raises: engine refusals (400), LoRA adapters (not found 404;
invalid, conflicting or disabled 400; unreadable since loading 503), a dead engine loop (503), a
failed engine step (500, logged), and a client that left while its request was read (400).
"""
from __future__ import annotations

from typing import Callable

from protocol import http_errors
from protocol.openai_api import INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, SERVICE_UNAVAILABLE, OpenAIError
from worker.engine.errors import (EngineDeadError, EngineStepError, InvalidLoRAAdapterError, InvalidRequestError,
                                  LoRAAdapterConflictError, LoRAAdapterNotFoundError, LoRADisabledError,
                                  LoRAUnavailableError)

WORKER_HEADER = "X-Prefixlb-Worker-Id"
# The split of usage's cached_tokens: prefix-cache hit on the GPU, loaded from the CPU KV tier.
CACHED_GPU_HEADER = "X-Prefixlb-Cached-Tokens-Gpu"
CACHED_CPU_HEADER = "X-Prefixlb-Cached-Tokens-Cpu"


def engine_error(exc: Exception) -> OpenAIError | None:
    """The OpenAI error for an exception only the worker raises; None for any other."""
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, str(exc), INVALID_REQUEST)
    for kind, status, type_, code in _LORA_ERRORS:
        if isinstance(exc, kind):
            return OpenAIError(status, str(exc), type_, code=code)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, "The engine has stopped; this worker cannot serve", SERVICE_UNAVAILABLE,
                           code="engine_dead")
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, "The engine failed while computing this request", SERVER_ERROR,
                           code="engine_step_failed")
    if isinstance(exc, ConnectionResetError):
        # The client went away while we read its request (e.g. a router gave up on this worker
        # while it was stopped): nobody will read the answer, and it is not a server error.
        return OpenAIError(400, "The client closed the connection", INVALID_REQUEST, code="client_disconnected")
    return None


_LORA_ERRORS = (
    (LoRAAdapterNotFoundError, 404, NOT_FOUND, "lora_adapter_not_found"),
    (InvalidLoRAAdapterError, 400, INVALID_REQUEST, "invalid_lora_adapter"),
    (LoRAAdapterConflictError, 400, INVALID_REQUEST, "lora_adapter_conflict"),
    (LoRADisabledError, 400, INVALID_REQUEST, "lora_disabled"),
    (LoRAUnavailableError, 503, SERVICE_UNAVAILABLE, "lora_adapter_unavailable"),
)


def map_exception(exc: Exception) -> OpenAIError:
    """The OpenAI error (its ``status`` included) for anything a handler or a stream raised."""
    return http_errors.openai_error(exc, engine_error)


def error_middleware(worker_id: str, on_error: Callable[[int], None] | None = None):
    """The shared error middleware with the worker's exceptions; every response names the worker."""
    return http_errors.error_middleware(engine_error, on_error=on_error, headers={WORKER_HEADER: worker_id})
