"""The router's port: a lean HTTP/1.1 front for the two inference endpoints, aiohttp for the rest.

aiohttp's server machinery (its request handler, request and response objects, the middleware
chain around them) is a share of what the router spends on each proxied request. So the router's
port is served by :class:`Front`: each connection starts as a :class:`FrontProtocol`, which reads
requests itself when they are plain (``router/http/fast_head.py`` says which: ``POST /v1/completions`` or
``POST /v1/chat/completions``, HTTP/1.1, one ``Host`` and one ``Content-Length`` of at most
``fast_head.MAX_FAST_BODY`` bytes, none of the headers aiohttp handles itself, the whole head in hand
and the body arriving within :data:`BODY_WAIT_S`) and runs them through the same middlewares and
handlers as aiohttp would (errors, API keys, counts, the ``--processes`` stamp), answering with
the same status line and headers. Anything else (any other path or method, malformed or unusual
HTTP, a slow body, a partial head) hands the connection to aiohttp *before a byte of that request
is used*: the bytes read so far are fed to an aiohttp ``RequestHandler`` that takes the transport
over, so every edge case keeps aiohttp's (tested) answer, and the connection stays aiohttp's from
then on. Measured: docs/benchmarks.md, "Router overhead beside the peers".

Behaviours kept from aiohttp's server: a client that disconnects cancels its handler; keep-alive
with a 75 s idle timeout and TCP keep-alive probes; ``Connection: close`` honoured; pipelined
requests answered in order; back-pressure on answers to slow readers; streams written chunked as
they arrive; ``Date`` and ``Server`` headers; ``on_response_prepare`` signals. ``--no-fast-front``
serves the port with aiohttp alone. One task serves a connection's requests in turn (idle, it
waits for the next), not one task a request; whole answers are :class:`FastResponse`, not
aiohttp's ``web.Response``.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from http import HTTPStatus
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from aiohttp.tcp_helpers import tcp_keepalive
from multidict import CIMultiDict, CIMultiDictProxy

from protocol.openai_errors import SERVER_ERROR, error_body
from router.fleet.upstream import header_lines
from router.http.fast_head import HeadShapes

log = logging.getLogger("prefixlb.router.front")

MAX_FAST_HEAD = 8190  # a longer head goes to aiohttp (its limits, its 4xx: a line or field of 8,190 bytes)
BODY_WAIT_S = 0.1  # a body not all in within this after its head: aiohttp takes the connection
KEEPALIVE_S = 75.0  # aiohttp's keepalive_timeout
MAX_BUFFERED = 1 << 20  # bytes of pipelined requests held while one is answered; then reading pauses
REASONS = {s.value: s.phrase for s in HTTPStatus}

Handler = Callable[[Any], Awaitable[web.StreamResponse]]


class FastBody:
    """``request.content`` of a fast request: the whole body, already received."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def is_eof(self) -> bool:
        return True

    def read_nowait(self, n: int = -1) -> bytes:
        data, self._data = self._data, b""
        return data


class FastRequest(dict):
    """The part of ``web.Request`` the inference handlers and middlewares use (a dict, as a
    ``web.Request`` is a mutable mapping for middlewares to note things in)."""

    __slots__ = ("app", "config_dict", "headers", "path", "method", "content_length", "content",
                 "keep_alive", "protocol")
    version = HttpVersion11

    def __init__(self, app: web.Application, path: str, headers: CIMultiDictProxy, body: bytes,
                 keep_alive: bool, protocol: "FrontProtocol") -> None:
        # (no dict.__init__: the mapping starts empty without it)
        self.app = self.config_dict = app
        self.path = path
        self.method = "POST"
        self.headers = headers
        self.content_length = len(body)
        self.content = FastBody(body)
        self.keep_alive = keep_alive
        self.protocol = protocol


class FastResponse:
    """A whole answer to a request the fast front reads: the part of ``web.Response`` that the
    middlewares, the virtual models and :meth:`FrontProtocol._answer` use (``status``,
    ``reason``, ``headers``, ``body``, ``keep_alive``, ``prepared``), without building aiohttp's
    response (2.3 -> 0.9 us an answer). :meth:`FrontProtocol._answer` writes it as aiohttp
    writes a ``web.Response``."""

    __slots__ = ("status", "reason", "headers", "body", "keep_alive", "prepared")

    def __init__(self, body: bytes, status: int, headers: Mapping[str, str]) -> None:
        self.body = body
        self.status = status
        self.reason = REASONS.get(status, "")
        self.headers = CIMultiDict(headers)
        self.keep_alive: bool | None = None
        self.prepared = False


def loop_of(request: Any) -> asyncio.AbstractEventLoop:
    """The loop serving ``request``: its fast-front connection's, else the running loop (asyncio's
    ``get_running_loop`` is a getpid() system call on CPython 3.11, its check against a fork: a
    request's path asks for the loop several times)."""
    return request.protocol.loop if type(request) is FastRequest else asyncio.get_running_loop()


WHOLE_RESPONSES = (web.Response, FastResponse)  # answers with a ``body`` not yet sent


def whole_response(request: Any, body: bytes, status: int, headers: Mapping[str, str]) -> web.Response:
    """A whole answer to ``request``: aiohttp's ``web.Response``, or, for a request the fast
    front reads, a :class:`FastResponse` (the same bytes on the wire)."""
    if isinstance(request, FastRequest):
        return FastResponse(body, status, headers)  # type: ignore[return-value]
    return web.Response(body=body, status=status, headers=headers)


def stream_response(request: Any, status: int, headers: Mapping[str, str]) -> web.StreamResponse:
    """A streamed answer to ``request``: aiohttp's ``StreamResponse``, or, for a request the fast
    front reads, a :class:`FastStream` with the same ``prepare`` / ``write`` / ``write_eof``."""
    if isinstance(request, FastRequest):
        return FastStream(status, headers)  # type: ignore[return-value]
    return web.StreamResponse(status=status, headers=headers)


class FastStream:
    """A chunked response written straight to a :class:`FrontProtocol`'s transport. Its head goes
    out with its first bytes (one write, one segment: the client's first event comes sooner), or
    with the end of a stream that had none."""

    __slots__ = ("status", "reason", "headers", "prepared", "keep_alive", "_protocol", "_eof", "_head")

    def __init__(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.reason = REASONS.get(status, "")
        self.headers = CIMultiDict(headers)
        self.prepared = False
        self.keep_alive: bool | None = None
        self._protocol: FrontProtocol | None = None
        self._eof = False
        self._head = b""  # prepared, not yet written

    async def prepare(self, request: FastRequest) -> None:
        if self.prepared:
            return
        self._protocol = request.protocol
        headers = self.headers
        headers["Transfer-Encoding"] = "chunked"
        keep_alive = self.keep_alive = request.keep_alive if self.keep_alive is None else self.keep_alive
        await _prepare_headers(request, self, headers, keep_alive)
        self.prepared = True
        self._head = _head(self.status, self.reason, headers)

    def _write(self, data: bytes) -> None:
        protocol = self._protocol
        assert protocol is not None, "prepare() first"
        if self._head:
            data, self._head = self._head + data, b""
            protocol.head_sent = True
        protocol.write(data)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        self._write(b"%x\r\n%b\r\n" % (len(data), data))
        if self._protocol.paused:  # type: ignore[union-attr]
            await self._protocol.drain()  # type: ignore[union-attr]

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof:
            return
        self._eof = True
        # the last bytes and the end in one write (one segment, one system call)
        self._write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        if self._protocol.paused:  # type: ignore[union-attr]
            await self._protocol.drain()  # type: ignore[union-attr]


async def _prepare_headers(request: FastRequest, response: Any, headers: CIMultiDict, keep_alive: bool) -> None:
    """What aiohttp's ``StreamResponse._prepare_headers`` and the app's prepare hook add."""
    _default_headers(headers, keep_alive)
    signal = request.app.on_response_prepare
    if len(signal):
        await signal.send(request, response)


def _default_headers(headers: CIMultiDict, keep_alive: bool) -> None:
    """What aiohttp's ``StreamResponse._prepare_headers`` adds."""
    if "Date" not in headers:
        headers["Date"] = rfc822_formatted_time()
    headers.setdefault("Server", SERVER_SOFTWARE)
    if not keep_alive and "Connection" not in headers:
        headers["Connection"] = "close"


def _head(status: int, reason: str, headers: Mapping[str, str]) -> bytes:
    """The status line and headers, as aiohttp serialises them (refusing a newline in either)."""
    return f"HTTP/1.1 {status} {reason}\r\n{header_lines(headers)}\r\n".encode("utf-8")


class Front:
    """Protocol factory for the router's port (``loop.create_server(front, ...)``)."""

    def __init__(self, app: web.Application, aiohttp_server: web.Server,
                 routes: Mapping[str, Handler]) -> None:
        self.app = app
        self.aiohttp_server = aiohttp_server
        chain: Callable[[Handler], Handler] = lambda h: h  # noqa: E731
        for middleware in reversed(app.middlewares):
            chain = functools.partial(_wrap, middleware, chain)
        self.handlers = {path: chain(handler) for path, handler in routes.items()}
        self.heads = HeadShapes(self.handlers)
        self.connections: set[FrontProtocol] = set()
        self.requests = 0  # served on the fast path (the tests read it)
        self.handed_over = 0  # connections given to aiohttp

    def __call__(self) -> "FrontProtocol":
        return FrontProtocol(self)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Close every connection: idle ones now, busy ones once their answer is out (at most
        ``timeout`` seconds; the proxy's drain has ended their requests by then)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for conn in list(self.connections):
            conn.closing = True
            if conn.task is None:
                conn.close()
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()


def _wrap(middleware: Any, inner: Callable[[Handler], Handler], handler: Handler) -> Handler:
    return functools.partial(middleware, handler=inner(handler))


class FrontProtocol(asyncio.Protocol):
    """One client connection while the fast path serves it (see the module docstring)."""

    loop: asyncio.AbstractEventLoop  # (from connection_made)

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.task: asyncio.Task | None = None  # serving a request (None: idle)
        # One task serves the connection's requests one after another (a task a request cost its
        # creation and the loop's WeakSet of tasks, twice): idle, it waits on ``_waiter`` for the
        # next request. A request already in the buffer when one ends (pipelined) gets a new task,
        # as before, so that nothing left of one request's handler (a pending cancellation) meets
        # the next.
        self._runner: asyncio.Task | None = None
        self._waiter: asyncio.Future | None = None
        self.paused = False  # the client reads slower than we write
        self.reading_paused = False
        self.closing = False
        self.lost = False
        self._drain: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None  # a body's wait
        # Keep-alive: the connection closes KEEPALIVE_S after it went idle. One timer, moved on
        # only when it fires (not re-armed and cancelled around every request).
        self._keepalive: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # None while a request is read or answered
        self._waiting_body = False
        self.head_sent = False  # the current request's answer has begun

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The loop, once a connection: asyncio.get_running_loop() makes a getpid() system call
        # on CPython 3.11 (its check against a fork), and the requests' path would make several.
        self.loop = asyncio.get_running_loop()
        self.transport = transport  # type: ignore[assignment]
        tcp_keepalive(transport)  # as aiohttp's server: a peer gone silently is found out
        self.front.connections.add(self)
        self._idle()

    def data_received(self, data: bytes) -> None:
        self.buffer = self.buffer + data if self.buffer else data
        if self.task is not None:  # pipelined behind the request being answered
            if len(self.buffer) > MAX_BUFFERED and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
            return
        self._next()

    def eof_received(self) -> bool | None:
        return None  # as aiohttp: the transport closes, a handler in progress is cancelled

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.front.connections.discard(self)
        self._cancel_timer()
        self._cancel_keepalive()
        if self._runner is not None:
            self._runner.cancel()  # the client went away: its handler stops (as aiohttp's handler_cancellation)
        self._wake(ConnectionResetError("Connection lost"))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake(None)

    # -- writing ---------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(data)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("Connection lost")
        if not self.paused:
            return
        waiter = self._drain
        if waiter is None:
            waiter = self._drain = self.loop.create_future()
        await waiter

    def _wake(self, exc: BaseException | None) -> None:
        waiter, self._drain = self._drain, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def close(self) -> None:
        self._cancel_timer()
        self._cancel_keepalive()
        if self.transport is not None:
            self.transport.close()

    # -- requests --------------------------------------------------------------------------------
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_keepalive(self) -> None:
        self._idle_since = None
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    def _idle(self) -> None:
        """Idle from now: closed after KEEPALIVE_S unless a request comes first."""
        self._cancel_timer()
        self._idle_since = self.loop.time()
        if self._keepalive is None:
            self._keep_alive_until(self._idle_since + KEEPALIVE_S)

    def _keep_alive_until(self, due: float) -> None:
        self._keepalive = self.loop.call_at(due, self._keepalive_due, due)

    def _keepalive_due(self, due: float) -> None:
        """The timer set for ``due`` fired: close if that is the current idle period's deadline
        (compared, not read off the clock: a timer may fire a little before its time)."""
        self._keepalive = None
        if self._idle_since is None:  # busy: idle again (and timed again) once its answer is out
            return
        deadline = self._idle_since + KEEPALIVE_S
        if due >= deadline:
            self.close()
        else:  # a request came and went since the timer was set
            self._keep_alive_until(deadline)

    def _next(self) -> None:
        """Serve the request at the start of the buffer, or hand the connection to aiohttp."""
        buffer = self.buffer
        if not buffer:
            return
        end = buffer.find(b"\r\n\r\n", 0, MAX_FAST_HEAD)
        handlers = self.front.handlers
        parsed = self.front.heads.parse(buffer[:end]) if end > 0 else None
        if parsed is None:
            self._handover()
            return
        handler = handlers[parsed[0]]
        _, headers, length, keep_alive = parsed
        start = end + 4
        self._idle_since = None
        if len(buffer) < start + length:
            if not self._waiting_body:
                self._waiting_body = True
                self._cancel_timer()
                self._timer = self.loop.call_later(BODY_WAIT_S, self._handover)
            return
        self._cancel_timer()
        self._waiting_body = False
        self.head_sent = False
        body = buffer[start:start + length]
        self.buffer = buffer[start + length:]
        request = FastRequest(self.front.app, parsed[0], headers, body, keep_alive, self)
        self.front.requests += 1
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # the connection's task, idle: it serves this one
            self.task = self._runner
            waiter.set_result((request, handler))
        else:  # (a waiter done: its task was cancelled while idle and is ending)
            self.task = self._runner = self.loop.create_task(self._run(request, handler))

    def _handover(self) -> None:
        """aiohttp takes this connection, with every byte not yet used (from the current
        request's first byte on)."""
        if self._runner is not None and self.task is None:  # idle: its task has no more to serve
            self._runner.cancel()
        self._cancel_timer()
        self._cancel_keepalive()
        self._waiting_body = False
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            return
        self.front.connections.discard(self)
        self.front.handed_over += 1
        handler = self.front.aiohttp_server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self.paused:  # the transport will not say so again
            handler.pause_writing()
        if self.reading_paused:
            transport.resume_reading()
        data, self.buffer = self.buffer, b""
        if data:
            handler.data_received(data)
        self.transport = None

    async def _run(self, request: FastRequest, handler: Handler) -> None:
        """Serve ``request``, then the connection's next ones while they come in separately."""
        runner = self._runner
        try:
            while True:
                # (each answer here, not in a coroutine of its own)
                keep_alive = request.keep_alive
                try:
                    response = await handler(request)
                    if isinstance(response, FastStream):
                        keep_alive = bool(response.keep_alive) and response._eof
                    elif len(request.app.on_response_prepare):
                        keep_alive = await self._answer(request, response)
                    else:  # (_answer without its coroutine: no prepare hook to await)
                        keep_alive = self._prepare_whole(request, response)
                        if keep_alive is None:  # not to be written (a second answer)
                            keep_alive = False
                        else:
                            self._write_whole(response)
                            if self.paused:  # the client reads slower than it asks: answer the next once this is out
                                await self.drain()
                except asyncio.CancelledError:
                    self.task = None
                    if not self.lost:
                        self.close()
                    raise
                except ConnectionError:
                    keep_alive = False
                except Exception:  # noqa: BLE001 - the error middleware answers everything a handler raises
                    self._answer_crash(request)
                    keep_alive = False
                if not self._answered(keep_alive):
                    return
                if self.buffer:  # pipelined (or a head in part): a task of its own, as before
                    self._runner = None
                    self._next()
                    return
                waiter = self._waiter = self.loop.create_future()
                request, handler = await waiter
        finally:
            if self._runner is runner:
                self._runner = self._waiter = None

    def _answer_crash(self, request: FastRequest) -> None:
        """A handler failed past the error middleware: a 500 when no answer has begun."""
        log.exception("event=front_answer_failed path=%s", request.path)
        if not self.head_sent:
            body = json.dumps(error_body("Internal server error", SERVER_ERROR)).encode()
            try:
                self.write(_head(500, "Internal Server Error", {
                    "Content-Type": "application/json; charset=utf-8", "Content-Length": str(len(body)),
                    "Connection": "close"}) + body)
            except ConnectionError:
                pass

    def _answered(self, keep_alive: bool) -> bool:
        """The current request is answered: whether the connection is idle and open for the next one."""
        self.task = None
        if self.lost:
            return False
        if not keep_alive or self.closing:
            self.close()
            return False
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        self._idle()
        return True

    async def _answer(self, request: FastRequest, response: web.StreamResponse) -> bool:
        """Write a whole (not streamed) response as aiohttp would; whether to keep the connection."""
        keep_alive = self._prepare_whole(request, response)
        if keep_alive is None:
            return False
        signal = request.app.on_response_prepare
        if len(signal):
            await signal.send(request, response)
        self._write_whole(response)
        if self.paused:  # the client reads slower than it asks: answer the next once this is out
            await self.drain()
        return keep_alive

    def _prepare_whole(self, request: FastRequest, response: web.StreamResponse) -> bool | None:
        """A whole response's headers, as aiohttp completes them (the prepare hook aside); whether
        to keep the connection, or None when it must not be written at all."""
        if response.prepared or self.head_sent:
            # a second answer after a stream began (aiohttp: "Response is sent already"): the
            # stream is cut (the client sees it unterminated), never followed by another head
            log.warning("event=front_second_response path=%s status=%d", request.path, response.status)
            return None
        body = response.body if isinstance(response, WHOLE_RESPONSES) else None
        if body is not None and not isinstance(body, (bytes, bytearray)):
            raise TypeError(f"unsupported body type {type(body).__name__} on the fast path")
        headers = response.headers
        headers["Content-Length"] = str(len(body) if body else 0)
        if body:
            headers.setdefault("Content-Type", "application/octet-stream")
        keep_alive = request.keep_alive if response.keep_alive is None else response.keep_alive
        _default_headers(headers, keep_alive)  # (_prepare_headers without its coroutine when no hook)
        return keep_alive

    def _write_whole(self, response: web.StreamResponse) -> None:
        """Write a whole response whose headers :meth:`_prepare_whole` completed."""
        body = response.body if isinstance(response, WHOLE_RESPONSES) else None
        head = _head(response.status, response.reason, response.headers)
        self.write(head + body if body else head)
