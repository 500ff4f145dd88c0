"""ScoringEndpoint: POST a JSON payload to a scoring service, get a JSON object back, in time.

Shared by the HTTP verifier judge (``{prompt, response} -> {accept, score}``) and the route
classifier (``{prompt} -> {score}``). Everything that can go wrong — the deadline, a refused
connection, a non-2xx status, a body that is not a JSON object or is too large — is one of two
exceptions, so each caller applies its own failure policy in one place. The reply is input
from another service: its size is bounded and its shape is checked by the caller.
"""
from __future__ import annotations

import asyncio
from typing import Any, Mapping

import aiohttp

from protocol import untrusted_json

MAX_REPLY_BYTES = 64 * 1024


class ScoringError(Exception):
    """The endpoint did not give a usable answer; ``reason``: connect | status | invalid_reply."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class ScoringTimeout(ScoringError):
    """No complete answer within the deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__("timeout", f"no answer within {timeout_s:g} s")


class ScoringEndpoint:
    """One scoring URL with a deadline per call. ``session``: the caller's aiohttp session
    (the router's, so connections are pooled); without one a session is made on first use
    and closed by :meth:`close`."""

    def __init__(self, url: str, timeout_s: float, headers: Mapping[str, str] | None = None,
                 session: aiohttp.ClientSession | None = None, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.url = url
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.max_reply_bytes = max_reply_bytes
        self._session = session
        self._owns_session = session is None

    async def post(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The endpoint's JSON object answer to ``payload`` (ScoringTimeout / ScoringError)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._session.post(self.url, json=dict(payload), headers=self.headers) as resp:
                    raw = await resp.content.read(self.max_reply_bytes + 1)
                    status = resp.status
        except TimeoutError:
            raise ScoringTimeout(self.timeout_s) from None
        except aiohttp.ClientError as exc:
            raise ScoringError("connect", f"{self.url}: {exc!r}") from None
        if not 200 <= status < 300:
            raise ScoringError("status", f"{self.url} answered HTTP {status}")
        if len(raw) > self.max_reply_bytes:
            raise ScoringError("invalid_reply", f"reply larger than {self.max_reply_bytes} bytes")
        try:
            body = untrusted_json.loads(raw)
        except ValueError:
            raise ScoringError("invalid_reply", "reply is not JSON") from None
        if not isinstance(body, dict):
            raise ScoringError("invalid_reply", "reply is not a JSON object")
        return body

    async def close(self) -> None:
        """Close the session this endpoint made (never the caller's)."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None


def finite_score(body: Mapping[str, Any], key: str = "score", required: bool = False) -> float | None:
    """``body[key]`` as a finite number (None when absent and not required); ScoringError else."""
    value = body.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
            float("inf"), float("-inf")):
        raise ScoringError("invalid_reply", f"{key!r} must be a finite number, got {value!r}")
    return float(value)
