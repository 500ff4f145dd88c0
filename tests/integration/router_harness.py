"""In-process harness for router tests: the real router app, and a scripted worker to test against.

The scripted worker speaks the worker HTTP API (``/load``, ``/v1/models``, ``/v1/completions``
streaming and not) and lets a test decide exactly when each byte is sent, or that it fails --
the only way to prove properties like "the first event reaches the client before the worker
has finished" or "a client disconnect reaches the worker" without timing assumptions;
``FaultyWorker`` adds the faults (errors, a connection dropped mid-stream, hangs). The
cluster tests (``test_router_cluster.py``) use real worker processes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import web
from aiohttp.test_utils import TestServer

from protocol.http_errors import app_runner
from router.app import Listener, build_app
from router.config import RouterConfig, load_router_config
from router.context import RouterContext, build_context, start, stop
from tests.support import free_port

USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
         "prompt_tokens_details": {"cached_tokens": 32}}


@dataclass
class ScriptedWorker:
    """A worker whose answers the test scripts: ``mode`` is ``ok``, ``gated``, ``held`` or ``error``.

    ``gated`` holds a stream back after its first event, ``held`` holds any answer back before its
    first byte, both until ``gate`` is set.
    """

    worker_id: str
    model: str = "m"
    mode: str = "ok"
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    first_sent: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/load", self._load)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        return app

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response({"worker_id": self.worker_id, "block_size": 16, "max_num_seqs": 8})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        headers = {"X-Prefixlb-Worker-Id": self.worker_id}
        if self.mode == "error":
            return web.json_response({"error": {"message": "boom"}}, status=503, headers=headers)
        if self.mode == "held":
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
        if not body.get("stream"):
            return web.json_response({"id": "c1", "object": "text_completion", "model": self.model,
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                      "usage": USAGE}, headers=headers)
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await response.write(_event({"choices": [{"index": 0, "text": "a"}], "usage": None}))
            self.first_sent.set()
            if self.mode == "gated":
                await self.gate.wait()
            await response.write(_event({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}],
                                         "usage": None}))
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(_event({"choices": [], "usage": USAGE}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return response


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def scripted_workers(*ids: str, model: str = "m",
                           kind: type[ScriptedWorker] = ScriptedWorker) -> AsyncIterator[list[ScriptedWorker]]:
    """Start scripted workers (of class ``kind``) on free loopback ports."""
    workers = [kind(i, model) for i in ids]
    try:
        for w in workers:
            w.server = TestServer(w.app(), host="127.0.0.1", port=free_port())
            await w.server.start_server()
        yield workers
    finally:
        for w in workers:
            w.gate.set()
            if w.server is not None:
                await w.server.close()


class FaultyWorker(ScriptedWorker):
    """A scripted worker with faults. ``mode``: ``ok``, ``error`` (503), ``draining`` (503 as a
    draining worker says it), ``die`` (first event, then the connection drops), ``no_done``
    (a stream that ends without ``[DONE]``), ``hang`` (never answers); ``probe_hang`` makes its
    ``/load`` hang too (a stopped process answers nothing)."""

    probe_hang: bool = False
    requests: int = 0

    async def _load(self, request: web.Request) -> web.Response:
        if self.probe_hang:
            await asyncio.Event().wait()
        return await super()._load(request)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.mode == "hang":
            await request.read()
            await asyncio.Event().wait()
        if self.mode == "draining":
            await request.read()
            return web.json_response({"error": {"message": "draining", "type": "service_unavailable_error",
                                                "param": None, "code": "draining"}}, status=503)
        if self.mode not in ("die", "no_done"):
            return await super()._completions(request)
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_event({"choices": [{"index": 0, "text": "a"}]}))
        self.first_sent.set()
        if self.mode == "die":
            await self.gate.wait()
            request.transport.abort()  # like a killed process: the connection just drops
            return response
        await response.write(_event({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}))
        await response.write_eof()  # a clean end, but no [DONE]
        return response


def faulty_workers(*ids: str) -> contextlib.AbstractAsyncContextManager[list[FaultyWorker]]:
    """Start :class:`FaultyWorker` s on free loopback ports."""
    return scripted_workers(*ids, kind=FaultyWorker)  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def running_router(*argv: str) -> AsyncIterator[tuple[RouterContext, str]]:
    """The real router app in this process (started like ``prefixlb router argv``): (context, URL)."""
    cfg: RouterConfig = load_router_config(list(argv), environ={})
    ctx = build_context(cfg)
    await start(ctx)
    # Served as `prefixlb router` serves it: the fast front, then aiohttp (router/app.py's Listener).
    listener = Listener(await app_runner(build_app(ctx)), cfg.fast_front)
    port = await listener.start("127.0.0.1", 0)
    try:
        yield ctx, f"http://127.0.0.1:{port}"
    finally:
        await listener.close()
        await stop(ctx)


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` on the event loop until true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
