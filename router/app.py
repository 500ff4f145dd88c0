"""The router's aiohttp application and its serve loop.

:func:`build_app` wires a :class:`~router.context.RouterContext` into an application;
:func:`serve` synchronises state *before* binding the port (so a health check that passes
means the router routes warm), serves until SIGINT/SIGTERM, and shuts down in order.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

from aiohttp import web

from protocol.http_errors import app_runner, error_middleware
from router.http.admin import admin_app
from router.http.api import CONTEXT, FAST_ROUTES, add_routes, middlewares, own_metrics
from router.http.front import Front
from router.http.admission import RETRY_AFTER_S
from router.http.siblings import HEADER_PROCESS, ProcessSlot, Siblings
from router.config import RouterConfig
from router.routing import hotloop
from router.context import RouterContext, build_context, start, stop

log = logging.getLogger("prefixlb.router")
YOUNG_GC_THRESHOLD = 5000  # container allocations between the cyclic GC's young collections (Python's: 700)


def build_app(ctx: RouterContext) -> web.Application:
    """An application serving ``ctx`` (its parts are started by :func:`serve`); the admin API
    too, unless ``--admin-port`` gives it an application of its own (:func:`build_admin_app`)."""
    app = web.Application(middlewares=middlewares(ctx.config.api_keys), client_max_size=ctx.config.max_body_bytes)
    app[CONTEXT] = ctx
    add_routes(app)
    if ctx.config.admin_port is None:
        app.add_subapp("/admin/", admin_app())
    return app


def build_admin_app(ctx: RouterContext) -> web.Application:
    """The admin API alone, for ``--admin-port`` (a port that can be published more narrowly)."""
    app = web.Application(middlewares=middlewares(()))  # the admin token guards it, not the API keys
    app[CONTEXT] = ctx
    app.add_subapp("/admin/", admin_app())
    return app


def build_control_app(ctx: RouterContext) -> web.Application:
    """What a process of ``--processes N`` serves its siblings on its control socket: its own
    metrics, and the admin API that replayed changes reach (not replayed again)."""
    # Errors answered as on the port, but not counted: the answer a sibling gets is not a client's
    # (each scrape and admin change would count once more per process).
    app = web.Application(middlewares=[error_middleware(retry_after_s=RETRY_AFTER_S)])
    app[CONTEXT] = ctx
    app.router.add_get("/metrics", own_metrics)
    app.add_subapp("/admin/", admin_app(replicated=False))
    return app


class Listener:
    """The router's port: the fast front (``router/http/front.py``) in front of ``runner``'s
    aiohttp server, or that server alone (``--no-fast-front``)."""

    def __init__(self, runner: web.AppRunner, fast: bool) -> None:
        self.runner = runner
        self.front: Front | None = None
        if fast:
            assert runner.server is not None
            self.front = runner.app[CONTEXT].front = Front(
                runner.app, runner.server, FAST_ROUTES)
        self._server: asyncio.AbstractServer | None = None
        self._site: web.TCPSite | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on ``host:port``; returns the port bound (``port`` 0: a free one)."""
        if self.front is None:
            self._site = web.TCPSite(self.runner, host, port, backlog=1024, reuse_address=True, reuse_port=reuse_port)
            await self._site.start()
            return self.runner.addresses[0][1]
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.front, host, port, backlog=1024,
                                                reuse_address=True, reuse_port=reuse_port)
        return self._server.sockets[0].getsockname()[1]

    async def stop_accepting(self) -> None:
        """No new connections; those open are served on (for the shutdown grace)."""
        if self._site is not None:
            await self._site.stop()
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Close every connection (the fast front's, then aiohttp's: the runner's cleanup)."""
        await self.stop_accepting()
        if self.front is not None:
            await self.front.shutdown()
        await self.runner.cleanup()


def _stamp_process(index: int):
    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[HEADER_PROCESS] = str(index)
    return stamp


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None, slot: ProcessSlot | None = None) -> int:
    """Run the router until SIGINT/SIGTERM; returns the exit status.

    ``slot``: this is one of ``--processes N`` (``prefixlb/processes.py`` starts them): the ports
    are shared with the others (``SO_REUSEPORT``), and a control socket serves them.
    """
    ctx = build_context(cfg)
    apps = [build_app(ctx)]
    if cfg.admin_port is not None:
        apps.append(build_admin_app(ctx))
    if slot is not None:
        ctx.siblings = Siblings(slot)
        for app in apps:
            app.on_response_prepare.append(_stamp_process(slot.index))
    await start(ctx)
    runner = await app_runner(apps[0])
    admin_runner = await app_runner(apps[1]) if cfg.admin_port is not None else None
    control_runner = await app_runner(build_control_app(ctx)) if slot is not None else None
    shared = slot is not None  # the N processes listen on the same ports
    listener = Listener(runner, cfg.fast_front)
    gc_threshold: tuple[int, ...] | None = None
    try:
        await listener.start(cfg.host, cfg.port, reuse_port=shared)
        if admin_runner is not None:
            await web.TCPSite(admin_runner, cfg.host, cfg.admin_port, reuse_address=True, reuse_port=shared).start()
        if slot is not None and control_runner is not None:
            path = slot.socket(slot.index)
            if os.path.exists(path):
                os.unlink(path)  # the socket of this slot's previous process (restarted)
            await web.UnixSite(control_runner, path).start()
            with open(slot.ready_file(slot.index), "w", encoding="ascii") as f:
                f.write(str(os.getpid()))
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        log.info("event=router_listening host=%s port=%d admin_port=%d policy=%s affinity=%s workers=%d redis=%s "
                 "process=%s compiled_loops=%s", cfg.host, cfg.port, cfg.admin_port or cfg.port, cfg.policy,
                 cfg.affinity, len(ctx.registry), bool(cfg.redis), f"{slot.index + 1}/{slot.count}" if slot else "1/1",
                 hotloop.hot is not None)
        # Everything built so far (modules, the app, the fleet) lives as long as the process: the
        # cyclic GC need not scan it again in each full collection (~3 us a request under load).
        # And a young collection every 5,000 container allocations, not 700: each scans what is
        # alive at that moment, mostly requests in flight that die young anyway when it comes
        # later (GC time 90 -> 30 ms per 16,000 requests at c=32; a young collection ~1 ms).
        gc_threshold = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc_threshold[1:])
        if ready is not None:
            ready.set()
        await stopping.wait()
        log.info("event=router_stopping")
        await listener.stop_accepting()  # no new connections; requests in flight get the grace period
        await ctx.proxy.drain(cfg.shutdown_grace)
    finally:
        if control_runner is not None:
            await control_runner.cleanup()
        if ctx.siblings is not None:
            await ctx.siblings.close()
        if admin_runner is not None:
            await admin_runner.cleanup()
        await listener.close()
        await stop(ctx)
        if gc_threshold is not None:  # the process's collector as it was (serve() may be embedded)
            gc.set_threshold(*gc_threshold)
            gc.unfreeze()
    return 0
