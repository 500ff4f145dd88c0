"""OpenAI's error shape, and the exception that carries it to the HTTP edge.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Both servers raise :class:`OpenAIError` anywhere below their handlers and turn it into a
response in one place.
"""
from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"


class OpenAIError(Exception):
    """An error for the client, with its HTTP status, in OpenAI's shape (see :func:`error_body`)."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body to send."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, the shape OpenAI clients parse."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(400, message, INVALID_REQUEST, param, code)


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    """A 404 for a model this server does not serve."""
    return OpenAIError(404, f"The model {model!r} does not exist; served: {', '.join(served)}",
                       NOT_FOUND, "model", "model_not_found")


def body_too_large(limit: int) -> OpenAIError:
    """A 413 for a body over ``limit`` bytes."""
    return OpenAIError(413, f"Request body is larger than the limit of {limit} bytes",
                       INVALID_REQUEST, None, "request_too_large")
