"""A tiny HTTP client for the worker tests: status, headers and decoded body of one call."""
from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Reply:
    """One HTTP answer."""

    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)

    def sse(self) -> list[Any]:
        """The ``data:`` payloads of an SSE body, JSON-decoded, ``[DONE]`` kept as a string."""
        out = []
        for line in self.raw.decode().split("\n"):
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out


def call(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 30.0) -> Reply:
    """``method url`` with a JSON ``body`` (or ``raw`` bytes); never raises on HTTP errors."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def is_openai_error(reply: Reply) -> bool:
    """True when the body is ``{"error": {"message", "type", "param", "code"}}``."""
    try:
        err = reply.json["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
