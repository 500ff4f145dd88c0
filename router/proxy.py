"""Proxy: decide, forward to the chosen worker, pass the answer through as it arrives.

An attempt loop: decide -> send -> (streaming: wait for the first upstream bytes). A connection
error, a timeout, a 5xx, or a stream that ends before its first byte counts as a failed
attempt: the worker is excluded and the next decision is tried, up to ``max_attempts``. Nothing
has reached the client yet, so a retry is invisible to it. Once the first byte is forwarded the
response is committed: a failure after that ends the stream with an SSE error event.

Streaming is passed through event by event (``router/sse.py``), never buffered; the client
connection has TCP_NODELAY (aiohttp sets it on every transport, client and server side). A
client that disconnects cancels the handler (the server runs with handler cancellation), and
closing the upstream response drops that connection, which aborts the request on the worker.
Connections to workers are pooled (one ``ClientSession``, keep-alive).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import aiohttp
from aiohttp import web

from protocol.openai_api import SERVER_ERROR, SERVICE_UNAVAILABLE, OpenAIError, error_body
from router.balancer import Balancer, Booking
from router.metrics import RouterMetrics
from router.policy import Decision, NoCapacity
from router.prompt import PromptKey
from router.registry import WorkerRegistry
from router.sse import UsageTap, usage_numbers

log = logging.getLogger("prefixlb.router.proxy")

HEADER_WORKER = "X-Prefixlb-Worker"
HEADER_PREDICTED = "X-Prefixlb-Predicted-Cached-Tokens"
HEADER_REASON = "X-Prefixlb-Route-Reason"
PASS_BACK = ("Content-Type", "X-Request-Id", "X-Prefixlb-Worker-Id", "Cache-Control")
RETRY_AFTER_S = 1


class Overloaded(OpenAIError):
    """Every worker is at its hard limit: 429 with ``Retry-After``."""

    def __init__(self, message: str) -> None:
        super().__init__(429, message, "rate_limit_error", None, "overloaded")


@dataclass(slots=True)
class ProxyRequest:
    """A validated request, ready to route."""

    path: str
    body: bytes
    prompt: PromptKey
    stream: bool
    client_wants_usage: bool
    affinity: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    exclude: frozenset[str] = frozenset()


class _Failed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class Proxy:
    """Forwards requests to workers through one pooled client session."""

    def __init__(self, balancer: Balancer, registry: WorkerRegistry, metrics: RouterMetrics,
                 connect_timeout: float, read_timeout: float, max_attempts: int) -> None:
        self.balancer = balancer
        self.registry = registry
        self.metrics = metrics
        self.max_attempts = max_attempts
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the pooled session to the workers."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=75.0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                              auto_decompress=False)

    async def close(self) -> None:
        """Close the session (and its pooled connections)."""
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request, preq: ProxyRequest) -> web.StreamResponse:
        """Route ``preq`` and answer ``request`` with the chosen worker's response."""
        assert self._session is not None
        excluded = set(preq.exclude)
        failure: _Failed | None = None
        for attempt in range(self.max_attempts):
            decision = self._decide(preq, excluded, failure)
            url = self.registry.url_of(decision.worker_id)
            booking = self.balancer.dispatch(decision, preq.prompt, time.time())
            self.metrics.count_request(decision.worker_id, decision.reason)
            upstream: aiohttp.ClientResponse | None = None
            try:
                if url is None:
                    raise _Failed("unknown", "worker left the registry")
                upstream, first = await self._send(url, preq)
            except _Failed as exc:
                self.balancer.finish(booking, time.time())
                self.metrics.upstream_errors.labels(decision.worker_id, exc.kind).inc()
                worker = self.registry.get(decision.worker_id)
                if worker is not None and exc.kind in ("connect", "timeout", "disconnected"):
                    self.registry.mark_failed(worker, f"proxy: {exc}")
                log.warning("event=upstream_failed worker=%s kind=%s attempt=%d detail=%r",
                            decision.worker_id, exc.kind, attempt + 1, str(exc))
                excluded.add(decision.worker_id)
                failure = exc
                if attempt + 1 < self.max_attempts:
                    self.metrics.retries.inc()
                continue
            if preq.stream and upstream.status == 200:
                return await self._stream(request, preq, booking, upstream, first)
            return await self._complete(preq, booking, upstream, first)
        assert failure is not None
        raise OpenAIError(502, f"No worker could serve the request ({failure.kind}: {failure})",
                          SERVER_ERROR, None, "upstream_failed")

    def _decide(self, preq: ProxyRequest, excluded: set[str], failure: _Failed | None) -> Decision:
        started = time.perf_counter()
        try:
            decision = self.balancer.decide(preq.prompt, time.time(), preq.affinity, excluded)
        except NoCapacity as exc:
            if failure is not None:
                raise OpenAIError(502, f"No worker could serve the request ({failure.kind}: {failure})",
                                  SERVER_ERROR, None, "upstream_failed") from exc
            if exc.candidates:
                raise Overloaded(f"All workers are at their in-flight limit; retry in {RETRY_AFTER_S} s") from exc
            raise OpenAIError(503, "No healthy worker is available", SERVICE_UNAVAILABLE, None,
                              "no_workers") from exc
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        return decision

    async def _send(self, url: str, preq: ProxyRequest) -> tuple[aiohttp.ClientResponse, bytes]:
        """POST to the worker; for a streaming 200, also wait for its first bytes."""
        assert self._session is not None
        try:
            upstream = await self._session.post(url + preq.path, data=preq.body, headers=preq.headers)
        except asyncio.TimeoutError as exc:
            raise _Failed("timeout", "timed out connecting") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise _Failed("connect", f"{type(exc).__name__}: {exc}") from exc
        if upstream.status >= 500:
            upstream.close()
            raise _Failed("status", f"worker answered {upstream.status}")
        if not (preq.stream and upstream.status == 200):
            return upstream, b""
        try:
            first = await upstream.content.readany()
        except asyncio.TimeoutError as exc:
            upstream.close()
            raise _Failed("timeout", "no first byte in time") from exc
        except (aiohttp.ClientError, OSError) as exc:
            upstream.close()
            raise _Failed("disconnected", f"{type(exc).__name__}: {exc}") from exc
        if not first:
            upstream.close()
            raise _Failed("disconnected", "stream ended before its first byte")
        return upstream, first

    def _headers(self, booking: Booking, upstream: aiohttp.ClientResponse) -> dict[str, str]:
        headers = {name: upstream.headers[name] for name in PASS_BACK if name in upstream.headers}
        d = booking.decision
        headers[HEADER_WORKER] = d.worker_id
        headers[HEADER_PREDICTED] = str(d.predicted_cached_tokens)
        headers[HEADER_REASON] = d.reason
        return headers

    async def _complete(self, preq: ProxyRequest, booking: Booking, upstream: aiohttp.ClientResponse,
                        first: bytes) -> web.Response:
        usage: dict[str, Any] | None = None
        try:
            try:
                data = first + await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise OpenAIError(502, f"The worker failed mid-response: {type(exc).__name__}",
                                  SERVER_ERROR, None, "upstream_failed") from exc
            self.balancer.first_byte(booking, time.time())
            if upstream.status == 200:
                usage = _json_usage(data)
            return web.Response(body=data, status=upstream.status, headers=self._headers(booking, upstream))
        finally:
            upstream.release()
            self._finish(booking, usage)

    async def _stream(self, request: web.Request, preq: ProxyRequest, booking: Booking,
                      upstream: aiohttp.ClientResponse, first: bytes) -> web.StreamResponse:
        self.balancer.first_byte(booking, time.time())
        tap = UsageTap(strip=not preq.client_wants_usage)
        response = web.StreamResponse(status=200, headers=self._headers(booking, upstream))
        completed = False
        try:
            await response.prepare(request)
            out = tap.feed(first)
            if out:
                await response.write(out)
            try:
                async for chunk in upstream.content.iter_any():
                    out = tap.feed(chunk)
                    if out:
                        await response.write(out)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                # Committed: the client gets a clean error event instead of a truncated success.
                self.metrics.upstream_errors.labels(booking.decision.worker_id, "mid_stream").inc()
                event = error_body(f"The worker failed mid-stream: {type(exc).__name__}", SERVER_ERROR,
                                   None, "upstream_failed")
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            else:
                tail = tap.flush()
                if tail:
                    await response.write(tail)
                completed = True
            await response.write_eof()
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.client_disconnects.inc()
            raise
        finally:
            if completed:
                upstream.release()
            else:
                upstream.close()  # drop the connection: the worker aborts the request
            self._finish(booking, tap.usage)

    def _finish(self, booking: Booking, usage: dict[str, Any] | None) -> None:
        numbers = usage_numbers(usage)
        self.balancer.finish(booking, time.time(), numbers)
        if numbers is not None and numbers[1] is not None:
            self.metrics.observe_feedback(booking.decision.worker_id, booking.decision.predicted_cached_tokens,
                                          numbers[0], numbers[1])


def _json_usage(data: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None
