"""The admin API under /admin/, behind a bearer token.

=======  ==============================  ==================================================
method   path                            effect
=======  ==============================  ==================================================
GET      /admin/workers                  every known worker: state, models, load
POST     /admin/workers                  ``{"url": "http://host:port"}``: add a worker (or undrain it);
                                         optional ``"kind"`` (prefixlb, vllm, sglang, openai),
                                         ``"kv_events"`` / ``"kv_replay"`` (tcp://host:port)
DELETE   /admin/workers/{id}             remove a worker (by id or URL)
POST     /admin/workers/{id}/drain       no new work; removed once its requests are done
POST     /admin/workers/{id}/prewarm     ``{"top": K}``: send it the K hottest prefixes now
GET      /admin/config                   every setting (secrets masked) + the runtime ones
PUT      /admin/config                   ``{"affinity": 0.6, "policy": "least_load"}``
GET      /admin/index                    prefix-index size and counters
GET      /admin/usage                    tokens, cost and no-cache cost per model and tenant
GET      /admin/virtual-models           the virtual models served, and the real models behind them
PUT      /admin/virtual-models           ``{name: {route: ...} | {cascade: ...}}``: replace them all
=======  ==============================  ==================================================

Authentication: ``Authorization: Bearer <token>`` compared in constant time with
``--admin-token`` (env ``PREFIXLB_ROUTER_ADMIN_TOKEN``). No header: 401; a wrong token: 403;
no token configured: every admin call is refused (403). Runtime config changes and drains (and
their end: adding the worker's URL again) are shared with every router through Redis when it is
configured (``"shared": true`` in the answer); adding and removing workers is per router (workers
join every router through Redis self-registration or Kubernetes discovery). A router run with
``--processes N`` is one router here: a change is replayed on its other processes, and
``/admin/usage`` sums theirs (``router/http/siblings.py``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from protocol import untrusted_json
from protocol.api_keys import bearer_token, matches_any
from protocol.openai_api import OpenAIError
from protocol.settings import describe
from router.http.api import CONTEXT, Handler
from router.http.siblings import HEADER_APPLIED, REPLAYED_HEADERS, sum_json
from router.context import ConfigError, RouterContext
from router.fleet.backends import InvalidWorkerSpec, worker_spec
from router.fleet.registry import InvalidWorkerURL
from router.http.virtual import describe_virtual
from router.virtual_models.config import VirtualModelError, parse_virtual_models

log = logging.getLogger("prefixlb.router.admin")


def _error(status: int, message: str, type_: str, code: str) -> OpenAIError:
    return OpenAIError(status, message, type_, None, code)


def check_token(header: str | None, token: str | None) -> None:
    """Raise the 401/403 :class:`OpenAIError` unless ``header`` carries the bearer ``token``."""
    if not token:
        raise _error(403, "The admin API is disabled: start the router with --admin-token",
                     "permission_error", "admin_disabled")
    if not header:
        raise _error(401, "Missing 'Authorization: Bearer <token>'", "authentication_error", "missing_token")
    if not matches_any(bearer_token(header), [token]):
        raise _error(403, "Invalid admin token", "permission_error", "invalid_token")


@web.middleware
async def admin_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Guard every route of the admin sub-application with the bearer token."""
    check_token(request.headers.get("Authorization"), request.config_dict[CONTEXT].config.admin_token)
    return await handler(request)


@web.middleware
async def replicate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With ``--processes N``: a change that took here is replayed on the other processes (the
    same token and body); ``GET /admin/usage`` answers the processes' ledgers summed."""
    siblings = request.config_dict[CONTEXT].siblings
    if siblings is None:
        return await handler(request)
    if request.method == "GET":
        response = await handler(request)
        if request.path.endswith("/usage") and isinstance(response, web.Response) and response.status == 200:
            theirs = await siblings.gather("GET", request.path_qs, _replayed_headers(request))
            views = [json.loads(response.body)]
            for _, status, body in theirs:  # the other processes' views (one that is not JSON is left out)
                if status == 200:
                    with contextlib.suppress(ValueError):
                        views.append(untrusted_json.loads(body))
            response = web.json_response(sum_json(views))
            response.headers[HEADER_APPLIED] = f"{len(views)}/{siblings.slot.count}"
        return response
    body = await request.read()
    response = await handler(request)
    if response.status < 300 and not request.path.endswith("/prewarm"):
        theirs = await siblings.gather(request.method, request.path_qs, _replayed_headers(request), body)
        applied = 1 + sum(1 for _, status, _ in theirs if status < 300)
        if applied < siblings.slot.count:
            log.warning("event=admin_change_not_replayed path=%s applied=%d processes=%d", request.path, applied,
                        siblings.slot.count)
        response.headers[HEADER_APPLIED] = f"{applied}/{siblings.slot.count}"
    return response


def _replayed_headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in REPLAYED_HEADERS if name in request.headers}


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = untrusted_json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _error(400, "Body must be a JSON object", "invalid_request_error", "invalid_json") from None
    if not isinstance(body, dict):
        raise _error(400, "Body must be a JSON object", "invalid_request_error", "invalid_json")
    return body


def _worker_view(ctx: RouterContext, now: float) -> list[dict[str, Any]]:
    out = []
    for w in ctx.registry.all():
        item = w.to_dict()
        load = ctx.balancer.board.get(w.worker_id) if w.worker_id else None
        if load is not None:
            item.update(in_system=load.in_system, pending_s=round(load.pending_s(now), 4),
                        prefill_tokens_per_s=load.prefill_tokens_per_s, decode_step_s=load.decode_step_s,
                        max_inflight=load.max_inflight, block_size=load.block_size)
        out.append(item)
    return out


async def list_workers(request: web.Request) -> web.Response:
    """``GET /admin/workers``."""
    return web.json_response({"workers": _worker_view(request.config_dict[CONTEXT], time.time())})


async def add_worker(request: web.Request) -> web.Response:
    """``POST /admin/workers`` with ``{"url": ...}``."""
    ctx = request.config_dict[CONTEXT]
    body = await _json(request)
    spec = None
    fields = {key: body.get(key) for key in ("kind", "kv_events", "kv_replay")}
    if any(v is not None for v in fields.values()):
        if not all(v is None or isinstance(v, str) for v in (body.get("url"), *fields.values())):
            raise _error(400, "url, kind, kv_events and kv_replay must be strings", "invalid_request_error",
                         "invalid_worker")
        try:
            spec = worker_spec(body.get("url"), **fields)  # type: ignore[arg-type]
        except InvalidWorkerSpec as exc:
            raise _error(400, str(exc), "invalid_request_error", "invalid_worker") from None
    try:
        w = ctx.registry.add(body.get("url"), "admin", spec=spec)  # type: ignore[arg-type]
    except InvalidWorkerURL as exc:
        raise _error(400, str(exc), "invalid_request_error", "invalid_url") from None
    log.info("event=admin_worker_added url=%s", w.url)
    shared = await _share_drain(ctx, w.url, False)  # adding a drained worker's URL undrains it everywhere
    return web.json_response({**w.to_dict(), "shared": shared}, status=201)


async def remove_worker(request: web.Request) -> web.Response:
    """``DELETE /admin/workers/{id}``."""
    w = request.config_dict[CONTEXT].registry.remove(request.match_info["key"])
    if w is None:
        raise _error(404, "No such worker", "not_found_error", "worker_not_found")
    return web.json_response(w.to_dict())


async def drain_worker(request: web.Request) -> web.Response:
    """``POST /admin/workers/{id}/drain``."""
    ctx = request.config_dict[CONTEXT]
    w = ctx.registry.drain(request.match_info["key"])
    if w is None:
        raise _error(404, "No such worker", "not_found_error", "worker_not_found")
    shared = await _share_drain(ctx, w.url, True, w.worker_id)
    w.drain_shared = shared
    return web.json_response({**w.to_dict(), "shared": shared})


async def _share_drain(ctx: RouterContext, url: str, drained: bool, worker_id: str | None = None) -> bool:
    """Tell the other routers through Redis; False without Redis or while it is unreachable (this
    router's own drain holds regardless; the operator repeats it on the others, or once Redis is back)."""
    if ctx.state is None:
        return False
    try:
        await ctx.state.publish_drain(url, drained, worker_id)
        return True
    except (RedisError, OSError) as exc:
        log.warning("event=drain_not_shared url=%s error=%r", url, str(exc)[:200])
        return False


async def prewarm_worker(request: web.Request) -> web.Response:
    """``POST /admin/workers/{id}/prewarm`` with optional ``{"top": K}`` (default ``--prewarm-top``, else 8)."""
    ctx = request.config_dict[CONTEXT]
    w = ctx.registry.get(request.match_info["key"])
    if w is None:
        raise _error(404, "No such worker", "not_found_error", "worker_not_found")
    body = await _json(request) if request.can_read_body else {}
    top = body.get("top", ctx.config.prewarm_top or 8)
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= 1024:
        raise _error(400, "top must be an integer in [1, 1024]", "invalid_request_error", "invalid_top")
    result = await ctx.prewarmer.warm(w, top)
    return web.json_response({**result, "worker_id": w.worker_id, "tracked": len(ctx.prewarmer.hot)})


async def get_config(request: web.Request) -> web.Response:
    """``GET /admin/config``."""
    ctx = request.config_dict[CONTEXT]
    return web.json_response({"settings": describe(ctx.config), "runtime": ctx.runtime_config()})


async def set_config(request: web.Request) -> web.Response:
    """``PUT /admin/config``: change ``affinity`` / ``policy`` here and, via Redis, everywhere."""
    ctx = request.config_dict[CONTEXT]
    body = await _json(request)
    try:
        runtime = ctx.apply_runtime(body)
    except ConfigError as exc:
        raise _error(400, str(exc), "invalid_request_error", "invalid_config") from None
    shared = False
    if ctx.state is not None:
        try:
            await ctx.state.publish_config(runtime)
            shared = True
        except (RedisError, OSError) as exc:
            log.warning("event=config_not_shared error=%r", str(exc)[:200])
    return web.json_response({"runtime": runtime, "shared": shared})


async def index_stats(request: web.Request) -> web.Response:
    """``GET /admin/index``."""
    ctx = request.config_dict[CONTEXT]
    index = ctx.balancer.index
    stats = index.stats
    return web.json_response({"entries": len(index), "max_entries": index.max_entries,
                              "evicted_lru": stats.evicted_lru, "expired": stats.expired,
                              "removed": stats.removed, "inserted": stats.inserted,
                              "workers": index.workers(), "tokens_per_byte": ctx.balancer.token_ratios(),
                              "stream_id": ctx.state.last_id if ctx.state else None})


async def usage(request: web.Request) -> web.Response:
    """``GET /admin/usage``: the ledger (``router/cost/ledger.py``) with the price book's name."""
    return web.json_response(request.config_dict[CONTEXT].costs.snapshot())


def _virtual_view(ctx: RouterContext) -> dict[str, Any]:
    return {"virtual_models": {name: describe_virtual(vm) for name, vm in sorted(ctx.virtual_models.items())}}


async def get_virtual_models(request: web.Request) -> web.Response:
    """``GET /admin/virtual-models``."""
    return web.json_response(_virtual_view(request.config_dict[CONTEXT]))


async def set_virtual_models(request: web.Request) -> web.Response:
    """``PUT /admin/virtual-models``: validate the whole new set (400 naming the bad key, and
    nothing changes), then serve it. Per router: repeat it on every router."""
    ctx = request.config_dict[CONTEXT]
    body = await _json(request)
    try:
        models = parse_virtual_models(body)
    except VirtualModelError as exc:
        raise _error(400, str(exc), "invalid_request_error", "invalid_virtual_models") from None
    ctx.virtual_models = models
    log.info("event=virtual_models_replaced models=%s", ",".join(sorted(models)) or "-")
    return web.json_response(_virtual_view(ctx))


def admin_app(replicated: bool = True) -> web.Application:
    """The /admin/ sub-application (its own auth middleware, so inference requests skip it).

    ``replicated``: changes are replayed on the router's other processes (the control socket's
    copy, which receives the replays, is not).
    """
    app = web.Application(middlewares=[admin_auth, replicate] if replicated else [admin_auth])
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers/{key:.+}", remove_worker)
    app.router.add_post("/workers/{key}/drain", drain_worker)
    app.router.add_post("/workers/{key}/prewarm", prewarm_worker)
    app.router.add_get("/config", get_config)
    app.router.add_put("/config", set_config)
    app.router.add_get("/index", index_stats)
    app.router.add_get("/usage", usage)
    app.router.add_get("/virtual-models", get_virtual_models)
    app.router.add_put("/virtual-models", set_virtual_models)
    return app
