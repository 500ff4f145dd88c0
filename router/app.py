"""The router's aiohttp application and its serve loop.

:func:`build_app` wires a :class:`~router.context.RouterContext` into an application;
:func:`serve` synchronises state *before* binding the port (so a health check that passes
means the router routes warm), serves until SIGINT/SIGTERM, and shuts down in order.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from protocol.http_errors import app_runner
from router.http.admin import admin_app
from router.http.api import CONTEXT, add_routes, middlewares
from router.config import RouterConfig
from router.context import RouterContext, build_context, start, stop

log = logging.getLogger("prefixlb.router")


def build_app(ctx: RouterContext) -> web.Application:
    """An application serving ``ctx`` (its parts are started by :func:`serve`)."""
    app = web.Application(middlewares=middlewares(ctx.config.api_keys), client_max_size=ctx.config.max_body_bytes)
    app[CONTEXT] = ctx
    add_routes(app)
    app.add_subapp("/admin/", admin_app())
    return app


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None) -> int:
    """Run the router until SIGINT/SIGTERM; returns the exit status."""
    ctx = build_context(cfg)
    app = build_app(ctx)
    await start(ctx)
    runner = await app_runner(app)
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024, reuse_address=True)
        await site.start()
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        log.info("event=router_listening host=%s port=%d policy=%s affinity=%s workers=%d redis=%s",
                 cfg.host, cfg.port, cfg.policy, cfg.affinity, len(ctx.registry), bool(cfg.redis))
        if ready is not None:
            ready.set()
        await stopping.wait()
        log.info("event=router_stopping")
    finally:
        await runner.cleanup()
        await stop(ctx)
    return 0
