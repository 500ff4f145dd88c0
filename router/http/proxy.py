"""Proxy: admit, decide, forward to the chosen worker, pass the answer through as it arrives.

**Admission.** A request first takes a slot under the router's global in-flight limit; when
there is none, or every candidate worker is at its hard limit, it waits in the bounded queue of
``router/http/admission.py`` (429 + ``Retry-After`` when full or too slow).

**Attempts.** decide -> send -> wait for the first upstream bytes (streaming) or the whole body
(non-streaming). A connection error, a timeout, a 5xx, a body cut short, or a stream that ends
before its first byte is a failed attempt: the worker is excluded and the next decision is tried,
at most ``max_attempts`` times and only while the request is younger than ``retry_deadline_s``.
Nothing has reached the client yet, so a retry is invisible to it. When no attempt is left the
client gets an OpenAI-shaped 502 (``upstream_failed``); with no routable worker at all, a 503.
Each attempt books its worker for the time it runs and releases the booking exactly once,
however it ends (``router/http/booking.py``).

**After the first byte** (streaming) the response is committed: if the worker fails, hangs, or
ends its stream without ``data: [DONE]``, the client gets an SSE error event
(``{"error": {..., "code": "upstream_failed"}}``) and ``data: [DONE]`` -- never a silent,
truncated "success", never a hang.

**Hung workers.** Every attempt runs under an abortable guard registered under its worker; when
the worker's breaker opens (``WorkerRegistry.on_unavailable``), :meth:`Proxy.abort_worker`
expires those guards at once: requests still waiting for a first byte are retried elsewhere,
streams in progress end with the error event. So a stopped worker (SIGSTOP) costs its requests
one breaker delay, not ``--read-timeout``.

**Passive health.** Every outcome is reported to the registry: failures (not aborts, not a
worker saying it is draining) count towards the worker's breaker, successes reset it.

Streaming is passed through event by event (``router/http/sse.py``), never buffered; TCP_NODELAY is
on (aiohttp sets it on the client's side, ``router/fleet/upstream.py`` on the workers' side). A
client that disconnects cancels the handler (the server runs with handler cancellation), and
closing the upstream response drops that connection, which aborts the request on the worker.
Connections to workers are pooled.
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

from protocol import untrusted_json
from protocol.openai_api import SERVER_ERROR, SERVICE_UNAVAILABLE, OpenAIError, error_body
from router.http.admission import RETRY_AFTER_S, Admission, Overloaded
from router.routing.balancer import Balancer
from router.fleet.connections import WorkerConnections
from router.fleet.health import refused
from router.fleet.upstream import UpstreamResponse
from router.metrics import RouterMetrics, observe
from router.routing.policy import Decision, NoCapacity
from router.routing.prompt import PromptKey
from router.fleet.registry import WorkerRegistry
from router.http.booking import BookedAttempt, book
from router.http.front import stream_response, whole_response
from router.http.sse import EventTooLarge, UsageTap

__all__ = ["Proxy", "ProxyRequest", "Overloaded", "RETRY_AFTER_S", "HEADER_WORKER",
           "HEADER_PREDICTED", "HEADER_REASON"]

log = logging.getLogger("prefixlb.router.proxy")

HEADER_WORKER = "X-Prefixlb-Worker"
HEADER_PREDICTED = "X-Prefixlb-Predicted-Cached-Tokens"
HEADER_REASON = "X-Prefixlb-Route-Reason"
PASS_BACK = ("Content-Type", "X-Request-Id", "X-Prefixlb-Worker-Id", "Cache-Control")
ERROR_BODY_BYTES = 64 * 1024  # how much of a worker's 5xx body is read to learn why
MAX_RESPONSE_BYTES = 256 << 20  # a non-streaming answer larger than this is a failed attempt, not read whole
# Failure kinds that say nothing about the worker's health (not counted by its breaker).
NOT_HEALTH = ("aborted", "draining", "unknown")
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(kw_only=True, slots=True)
class ProxyRequest:
    """A validated request, ready to route: ``body`` is what the worker gets (``headers`` too),
    ``client_wants_usage`` whether the client asked for the usage chunk the router always asks
    for, ``exclude`` the workers that cannot serve its model. The fields after
    ``response_headers`` are what the access log says of it, filled in by the proxy as the
    request goes (here, not in a record of their own: one object a request less)."""

    path: str
    body: bytes
    prompt: PromptKey
    stream: bool
    client_wants_usage: bool
    affinity: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    exclude: frozenset[str] = frozenset()
    request_id: str = ""
    response_headers: Mapping[str, str] = field(default_factory=dict)  # added to the answer (a virtual model's)
    worker: str = "-"
    reason: str = "-"
    predicted_cached_tokens: int = 0
    ttfb_s: float | None = None
    attempts: int = 0
    booking: BookedAttempt | None = None  # the attempt that answered: its usage, once read
    # The running loop (router/http/front.py's loop_of: asyncio's get_running_loop() is a
    # getpid() system call on CPython 3.11); the proxy needs it for its times, its guards and
    # the booking's release.
    loop: asyncio.AbstractEventLoop


class _Failed(Exception):
    """A failed attempt (retryable: nothing reached the client)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


_ACTIVE, _EXPIRING, _EXPIRED = range(3)


class _Guard:
    """An attempt's abortable guard, registered under its worker so that :meth:`Proxy.abort_worker`
    can expire it: ``asyncio.timeout(None)``'s semantics -- :meth:`expire` cancels the task in
    the loop's next turn, and the cancellation leaves the block as a ``TimeoutError`` -- without
    an ``asyncio.Timeout`` and the coroutines around it (4.7 us an attempt; this, 1.6)."""

    __slots__ = ("_guards", "_loop", "_task", "_cancelling", "_state", "_handle")

    def __init__(self, guards: set, loop: asyncio.AbstractEventLoop) -> None:
        self._guards = guards
        self._loop = loop  # the running loop
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self._state = _ACTIVE
        self._handle: asyncio.Handle | None = None

    async def __aenter__(self) -> "_Guard":
        self.enter()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: Any) -> bool | None:
        self.leave(exc_type, exc)
        return None

    def enter(self) -> None:
        """``async with``'s entry, for a caller that calls :meth:`leave` itself (no coroutines)."""
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("Timeout should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._guards.add(self)

    def leave(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        """``async with``'s exit: raises the TimeoutError an expiry turns its cancellation into."""
        self._guards.discard(self)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._state == _EXPIRING:
            self._state = _EXPIRED
            # (as asyncio.Timeout) a cancellation of its own becomes a TimeoutError; any other
            # cancellation request still pending (the client went away) stays one
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:  # type: ignore[union-attr]
                raise TimeoutError from exc

    def expire(self) -> None:
        """End the guarded block: its task is cancelled in the loop's next turn."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_soon(self._on_expire)

    def _on_expire(self) -> None:
        self._task.cancel()  # type: ignore[union-attr]
        self._state = _EXPIRING
        self._handle = None

    def expired(self) -> bool:
        """True when the worker was aborted while this guard was active."""
        return self._state == _EXPIRING or self._state == _EXPIRED


def upstream_failed(failure: _Failed | None) -> OpenAIError:
    """The 502 a client gets when no attempt succeeded."""
    detail = f" ({failure.kind}: {failure})" if failure is not None else ""
    return OpenAIError(502, f"No worker could serve the request{detail}", SERVER_ERROR, None, "upstream_failed")


class Proxy:
    """Forwards requests to workers through the router's pooled ``connections``."""

    def __init__(self, balancer: Balancer, registry: WorkerRegistry, metrics: RouterMetrics,
                 connections: WorkerConnections, max_attempts: int, retry_deadline_s: float = 30.0,
                 admission: Admission | None = None) -> None:
        self.balancer = balancer
        self.registry = registry
        self.metrics = metrics
        self.connections = connections
        self.max_attempts = max_attempts
        self.retry_deadline_s = retry_deadline_s
        self.admission = admission if admission is not None else Admission()
        self._guards: dict[str, set] = {}
        self.closing = False  # the router is shutting down: no new attempt, no retry
        registry.on_unavailable.append(self.abort_worker)
        registry.on_removed.append(self._forget)

    def abort_worker(self, worker_id: str) -> int:
        """Expire every attempt in progress on ``worker_id`` now; returns how many."""
        guards = self._guards.get(worker_id)
        if not guards:
            return 0
        count = 0
        for guard in list(guards):
            if not guard.expired():
                guard.expire()
                count += 1
        log.warning("event=worker_requests_aborted worker=%s requests=%d", worker_id, count)
        return count

    async def drain(self, grace_s: float) -> int:
        """Shut down: let requests in flight finish for up to ``grace_s`` seconds, then end them --
        an open stream gets an SSE error event and ``[DONE]`` (never a silent cut), a request
        still waiting for its worker a 503. Returns how many were ended that way."""
        self.closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.admission.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.admission.inflight:
            return 0
        ended = 0
        for worker_id in list(self._guards):
            ended += self.abort_worker(worker_id)
        log.warning("event=shutdown_ended_requests requests=%d grace_s=%s", ended, grace_s)
        deadline = loop.time() + 2.0  # time for the ended streams to write their error event
        while self.admission.inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return ended

    def _forget(self, w: Any) -> None:
        """A worker left the registry: drop its (empty) guard set, so ids of pods long gone
        (Kubernetes replaces them under new names) do not pile up. Attempts still running keep
        their set, and abort_worker no longer reaches them, as for any removed worker."""
        if w.worker_id is not None and not self._guards.get(w.worker_id):
            self._guards.pop(w.worker_id, None)

    def _guard(self, worker_id: str, loop: asyncio.AbstractEventLoop) -> _Guard:
        guards = self._guards.get(worker_id)
        if guards is None:
            guards = self._guards[worker_id] = set()
        return _Guard(guards, loop)

    # -- the request ------------------------------------------------------------------------
    async def handle(self, request: web.Request, preq: ProxyRequest) -> web.StreamResponse:
        """Admit, route ``preq`` and answer ``request`` with the chosen worker's response."""
        loop = preq.loop
        arrived = loop.time()
        admission = self.admission
        deadline = admission.deadline(arrived)
        woken = False
        try:
            while not admission.try_enter(woken):
                await admission.wait(len(preq.body), deadline, front=woken)
                woken = True
        except Overloaded as exc:
            self.metrics.overloaded.labels(exc.reason).inc()
            raise
        if woken:
            self.metrics.queue_wait.observe(loop.time() - arrived)
        # The attempts, here rather than in a coroutine of their own (one a request less).
        try:
            excluded = preq.exclude  # (a new set only once an attempt fails)
            failure: _Failed | None = None
            attempts = 0
            queued = False
            while True:
                if self.closing:
                    raise OpenAIError(503, "The router is shutting down", SERVICE_UNAVAILABLE, None,
                                      "shutting_down")
                if attempts and (attempts >= self.max_attempts or loop.time() - arrived > self.retry_deadline_s):
                    raise upstream_failed(failure)
                started = time.perf_counter()
                try:
                    decision = self.balancer.decide(preq.prompt, time.time(), preq.affinity, excluded)
                except NoCapacity as exc:
                    await self._wait_for_capacity(exc, preq, failure, deadline, queued)
                    queued = True  # then decide again
                    continue
                observe(self.metrics.decision, time.perf_counter() - started)
                attempts += 1
                worker_id = decision.worker_id
                url = self.registry.url_of(worker_id)
                # Leaving this block (an answer, a failure, a client disconnect, a bug) releases the booking.
                with book(self.balancer, self.metrics, decision, preq.prompt) as booking:
                    self.metrics.count_request(worker_id, decision.reason)
                    preq.attempts = attempts
                    try:
                        upstream, first = await self._send(worker_id, url, preq)
                    except _Failed as exc:
                        failure = exc
                    else:
                        preq.worker, preq.reason = worker_id, decision.reason
                        preq.predicted_cached_tokens = decision.predicted_cached_tokens
                        preq.ttfb_s, preq.booking = loop.time() - arrived, booking
                        if preq.stream and upstream.status == 200:
                            return await self._stream(request, preq, booking, upstream, first)
                        response = self._complete(request, booking, upstream, first, preq.request_id,
                                                  preq.response_headers)
                        booking.release_after_answer(loop)
                        return response
                self._attempt_failed(worker_id, failure, attempts)
                excluded = excluded | {worker_id}
        finally:
            admission.leave()

    async def _wait_for_capacity(self, exc: NoCapacity, preq: ProxyRequest, failure: _Failed | None,
                                 deadline: float, queued: bool) -> None:
        """No candidate had capacity (``exc``): wait in the queue for some (then decide again),
        or, with no candidate at all, the 502 of the last failure or a 503."""
        if not exc.candidates:
            if failure is not None:
                raise upstream_failed(failure) from exc
            raise OpenAIError(503, "No healthy worker is available", SERVICE_UNAVAILABLE, None,
                              "no_workers") from exc
        waited = time.perf_counter()
        try:
            await self.admission.wait(len(preq.body), deadline, front=queued, holds_slot=True)
        except Overloaded as over:
            self.metrics.overloaded.labels(over.reason).inc()
            raise
        self.metrics.queue_wait.observe(time.perf_counter() - waited)

    def _attempt_failed(self, worker_id: str, exc: _Failed, attempt: int) -> None:
        """Count a failed attempt (its booking already released) against its worker."""
        now = time.time()
        self.metrics.upstream_errors.labels(worker_id, exc.kind).inc()
        if exc.kind == "draining":
            self.registry.report_draining(worker_id)
        elif exc.kind not in NOT_HEALTH:
            worker = self.registry.get(worker_id)
            if worker is not None:
                self.registry.mark_failed(worker, f"request: {exc.kind}: {exc}"[:200], now, exc.kind == "refused")
        log.warning("event=upstream_failed worker=%s kind=%s attempt=%d detail=%r", worker_id, exc.kind,
                    attempt, str(exc)[:200])
        if attempt < self.max_attempts:
            self.metrics.retries.inc()

    async def _send(self, worker_id: str, url: str | None,
                    preq: ProxyRequest) -> tuple[aiohttp.ClientResponse, bytes]:
        """POST to the worker; then its first bytes (streaming 200) or its whole body (otherwise).
        All of it under an abortable guard: an abort of the worker is an ``aborted`` failure."""
        if url is None:
            raise _Failed("unknown", "worker left the registry")
        guard = self._guard(worker_id, preq.loop)
        guard.enter()  # (async with guard, without its two coroutines)
        try:
            try:
                upstream = await self.connections.post(url, preq.path, preq.body, preq.headers)
            except asyncio.TimeoutError as exc:  # a connect timeout, or silence before the answer's head
                raise _Failed("timeout", "no answer in time" if isinstance(exc, aiohttp.ServerTimeoutError)
                              else "timed out connecting") from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise _Failed("refused" if refused(exc) else "connect", f"{type(exc).__name__}: {exc}") from exc
            try:
                if upstream.status >= 500:
                    raise _status_failure(upstream.status, await upstream.content.read(ERROR_BODY_BYTES))
                if preq.stream and upstream.status == 200:
                    first = await upstream.content.readany()
                    if not first:
                        raise _Failed("disconnected", "stream ended before its first byte")
                else:  # (an answer already in whole: taken without _read_capped's two reads)
                    first = upstream.body_nowait(MAX_RESPONSE_BYTES) if type(upstream) is UpstreamResponse else None
                    if first is None:
                        first = await _read_capped(upstream.content)
            except asyncio.TimeoutError as exc:
                upstream.close()
                raise _Failed("timeout", "no answer in time") from exc
            except (aiohttp.ClientError, OSError) as exc:
                upstream.close()
                raise _Failed("disconnected", f"{type(exc).__name__}: {exc}") from exc
            except BaseException:
                upstream.close()  # a _Failed, an abort or a client disconnect: drop the connection
                raise
        except BaseException as exc:
            try:
                guard.leave(type(exc), exc)
            except TimeoutError:
                if not guard.expired():
                    raise
                raise _Failed("aborted", "the worker was taken out of rotation") from None
            raise
        guard.leave(None, None)
        return upstream, first

    def _headers(self, booking: BookedAttempt, upstream: aiohttp.ClientResponse,
                 request_id: str = "", extra: Mapping[str, str] | None = None) -> dict[str, str]:
        given = upstream.headers
        headers = {}
        for name in PASS_BACK:  # (a loop: a comprehension is a function call of its own)
            value = given.get(name)
            if value is not None:
                headers[name] = value
        if extra:
            headers.update(extra)
        if request_id:
            headers["X-Request-Id"] = request_id
        d = booking.decision
        headers[HEADER_WORKER] = d.worker_id
        headers[HEADER_PREDICTED] = str(d.predicted_cached_tokens)
        headers[HEADER_REASON] = d.reason
        return headers

    def _complete(self, request: web.Request, booking: BookedAttempt, upstream: aiohttp.ClientResponse,
                  data: bytes, request_id: str = "", extra_headers: Mapping[str, str] | None = None) -> web.Response:
        try:
            booking.first_byte()
            if upstream.status == 200:
                booking.answered(data)
                self.registry.request_ok(booking.decision.worker_id, time.time())
            return whole_response(request, data, upstream.status,
                                  self._headers(booking, upstream, request_id, extra_headers))
        finally:
            upstream.release()

    async def _stream(self, request: web.Request, preq: ProxyRequest, booking: BookedAttempt,
                      upstream: aiohttp.ClientResponse, first: bytes) -> web.StreamResponse:
        worker_id = booking.decision.worker_id
        booking.first_byte()
        tap = UsageTap(strip=not preq.client_wants_usage)
        response = stream_response(request, 200, self._headers(booking, upstream, preq.request_id,
                                                               preq.response_headers))
        completed = False
        try:
            await response.prepare(request)
            failure: _Failed | None = None
            try:
                out = tap.feed(first)
            except EventTooLarge as exc:
                out, failure = b"", _Failed("oversized", str(exc))
            if failure is None and not tap.done:
                if out:
                    await response.write(out)
                failure, out = await self._pass_through(response, upstream, tap, worker_id, preq.loop)
            # ``out``: the stream's last events, written with its end (one write, not two)
            if failure is None:
                out += tap.flush()
                if not tap.done:
                    failure = _Failed("truncated", "the worker ended the stream without [DONE]")
            if failure is None:
                completed = True
                self.registry.request_ok(worker_id, time.time())
            else:
                if out:
                    await response.write(out)
                # Committed: the client gets a clean error event instead of a truncated success.
                if self.closing and failure.kind == "aborted":
                    event = error_body("The router is shutting down; the response is incomplete",
                                       SERVICE_UNAVAILABLE, None, "shutting_down")
                else:
                    self._stream_failed(worker_id, failure)
                    event = error_body(f"The worker failed mid-stream ({failure.kind}); the response is incomplete",
                                       SERVER_ERROR, None, "upstream_failed")
                out = b"data: " + json.dumps(event).encode() + b"\n\n" + DONE_EVENT
            await response.write_eof(out)
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.client_disconnects.inc()
            raise
        finally:
            if completed:
                release_after_end(upstream)  # the HTTP body's end may follow [DONE]
            else:
                upstream.close()  # drop the connection: the worker aborts the request
            booking.usage = tap.usage

    async def _pass_through(self, response: web.StreamResponse, upstream: aiohttp.ClientResponse,
                            tap: UsageTap, worker_id: str,
                            loop: asyncio.AbstractEventLoop) -> tuple[_Failed | None, bytes]:
        """Forward upstream events until the stream ends: the worker failure that ended it, if
        any, and the events of the read that ended it at ``data: [DONE]``, not written yet (the
        caller writes them with the answer's end).

        Only upstream reads are worker failures; a failed write to the client propagates.
        """
        guard = self._guard(worker_id, loop)
        content = upstream.content
        try:
            async with guard:
                while True:
                    try:
                        chunk = await content.readany()
                    except TimeoutError as exc:  # before ClientError: aiohttp's read timeout is both
                        return _Failed("timeout", f"no data for too long: {exc!r}"), b""
                    except (aiohttp.ClientError, OSError) as exc:
                        return _Failed("mid_stream", f"{type(exc).__name__}: {exc}"), b""
                    if not chunk:
                        return None, b""
                    try:
                        out = tap.feed(chunk)
                    except EventTooLarge as exc:
                        return _Failed("oversized", str(exc)), b""
                    if tap.done:  # the stream is over at [DONE], whether or not the body is
                        return None, out
                    if out:
                        await response.write(out)
        except TimeoutError:
            if not guard.expired():
                raise
            return _Failed("aborted", "the worker was taken out of rotation"), b""

    def _stream_failed(self, worker_id: str, failure: _Failed) -> None:
        self.metrics.upstream_errors.labels(worker_id, failure.kind).inc()
        if failure.kind not in NOT_HEALTH:
            worker = self.registry.get(worker_id)
            if worker is not None:
                self.registry.mark_failed(worker, f"stream: {failure.kind}: {failure}"[:200], time.time())
        log.warning("event=stream_failed worker=%s kind=%s detail=%r", worker_id, failure.kind, str(failure)[:200])


_DRAINS: set[asyncio.Task] = set()  # aiohttp answers read to their end after the client's stream ended


def release_after_end(upstream: Any, grace_s: float = 1.0) -> None:
    """Release a stream that ended at ``data: [DONE]``: its connection goes back to the pool once
    the HTTP body's end follows, within ``grace_s`` (a worker sends it at once), else it is closed."""
    if isinstance(upstream, UpstreamResponse):
        upstream.release_after_end(grace_s)
        return
    # aiohttp's ClientResponse (https workers) closes its connection if released before the end
    task = asyncio.get_running_loop().create_task(_drain_then_release(upstream, grace_s))
    _DRAINS.add(task)
    task.add_done_callback(_DRAINS.discard)


async def _drain_then_release(upstream: aiohttp.ClientResponse, grace_s: float) -> None:
    try:
        async with asyncio.timeout(grace_s):
            while await upstream.content.readany():
                pass  # after [DONE]: dropped
    except asyncio.CancelledError:  # the router stopping
        upstream.close()
        raise
    except (TimeoutError, aiohttp.ClientError, OSError):  # too slow, or failed: not reused
        upstream.close()
        return
    upstream.release()


async def _read_capped(content: aiohttp.StreamReader) -> bytes:
    """A whole non-streaming answer, or an ``oversized`` failure past ``MAX_RESPONSE_BYTES``."""
    chunks, size = [], 0
    while True:
        chunk = await content.readany()
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise _Failed("oversized", f"the worker's answer is larger than {MAX_RESPONSE_BYTES} bytes")
        chunks.append(chunk)


def _status_failure(status: int, body: bytes) -> _Failed:
    code = None
    try:
        error = untrusted_json.loads(body).get("error")
        code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        pass
    if status == 503 and code == "draining":
        return _Failed("draining", "the worker is draining")
    return _Failed("status", f"worker answered {status}" + (f" ({code})" if isinstance(code, str) else ""))
