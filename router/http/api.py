"""The OpenAI-compatible HTTP surface: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics.

Each inference request is read within the body limit, validated by ``protocol.openai_api``
(the same rules the workers apply), rendered and hashed (``router/routing/prompt.py``), and handed to
the proxy (:func:`forward`, which also records the answer's usage in the cost ledger). A request
naming a virtual model goes to ``router/http/virtual.py``, whose real calls all take
:func:`forward`. Errors are raised as ``OpenAIError`` anywhere below and turned into OpenAI-shaped
JSON once, by ``protocol/http_errors.py``'s middleware (the worker's too); API keys on ``/v1/*``
are ``protocol/api_keys.py``'s (see :func:`middlewares`).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import time
from typing import Awaitable, Callable, Mapping, Sequence

from aiohttp import web

from protocol import RenderError
from protocol.api_keys import api_key_middleware, bearer_token
from protocol.http_errors import error_middleware
from protocol.openai_api import (ChatCompletionRequest, CompletionRequest, OpenAIError, RequestLimits, bad_request,
                                 model_not_found, parse_request)
from protocol.openai_body import OFF_LOOP_BYTES, body_nowait, decode_off_loop, read_limited_body
from protocol.log_format import log_info
from protocol.version import version
from router.context import RouterContext
from router.cost.ledger import tenant_of
from router.http.siblings import merge_metrics
from router.metrics import CONTENT_TYPE
from router.routing.prompt import prompt_key, session_key_of
from router.http.front import loop_of
from router.http.proxy import RETRY_AFTER_S, ProxyRequest
from router.http.sse import usage_numbers
from router.http.virtual import describe_virtual, serve_virtual

CONTEXT = web.AppKey("context", RouterContext)
access_log = logging.getLogger("prefixlb.router.access")
HEADER_AFFINITY = "X-Prefixlb-Affinity"
FORWARDED_HEADERS = ("Authorization", "traceparent", "tracestate")  # and X-Request-Id, always (below)
HEADER_REQUEST_ID = "X-Request-Id"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def count_response(request: web.Request, status: int) -> None:
    """Count every answer by status (errors included: the error middleware calls it last)."""
    request.config_dict[CONTEXT].metrics.count_response(status)


def middlewares(api_keys: Sequence[str]) -> list:
    """The router's middlewares, outermost first: errors (protocol's, shared with the worker;
    429 and 503 carry ``Retry-After``; every answer counted by status), then API keys on
    ``/v1/*`` when there are keys (none: no layer)."""
    errors = error_middleware(retry_after_s=RETRY_AFTER_S, on_response=count_response)
    return [errors, api_key_middleware(api_keys)] if api_keys else [errors]


async def read_body(request: web.Request, limit: int, timeout: float = 30.0,
                    limits: RequestLimits | None = None) -> bytearray:
    """The request body: a 413 as soon as it exceeds ``limit`` bytes, a 408 after ``timeout`` s;
    with ``limits``, a 400 as soon as its JSON structure is over budget (while it arrives)."""
    return await read_limited_body(request.content_length, request.content, limit, timeout, limits)


def forwardable(name: str, value: str) -> str:
    """``value`` if it can go to a worker as a header (printable ASCII), else a 400."""
    if len(value) > 1024 or not value.isascii() or not value.isprintable():
        raise bad_request(f"Header {name} must be printable ASCII of at most 1024 characters", name,
                          "invalid_header")
    return value


def parse_affinity(value: str | None) -> float | None:
    """The ``X-Prefixlb-Affinity`` override: a number in [0, 1], or None when absent."""
    if value is None:
        return None
    try:
        affinity = float(value)
    except ValueError:
        raise bad_request(f"{HEADER_AFFINITY} must be a number in [0, 1]", HEADER_AFFINITY) from None
    if not math.isfinite(affinity) or not 0.0 <= affinity <= 1.0:
        raise bad_request(f"{HEADER_AFFINITY} must be a number in [0, 1]", HEADER_AFFINITY)
    return affinity


def with_include_usage(raw: bytes, body: dict) -> bytes:
    """The body asking the worker for a usage chunk at the end of a stream."""
    options = body.get("stream_options")
    if options is None and raw.rstrip().endswith(b"}"):
        # Splice instead of re-serialising a possibly huge prompt.
        end = raw.rstrip()
        return end[:-1] + b',"stream_options":{"include_usage":true}}'
    patched = dict(body)
    patched["stream_options"] = {**(options or {}), "include_usage": True}
    return json.dumps(patched, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _inference(request: web.Request, chat: bool) -> Awaitable[web.StreamResponse]:
    """Read, validate and route one inference request. (A plain function returning the
    coroutine that routes it: a body already in whole, the usual case, is read and parsed here,
    without a coroutine of its own; a 4xx found doing so is raised from the call.)"""
    ctx = request.app[CONTEXT]
    cfg = ctx.config
    limits = _limits(cfg.max_body_bytes)
    raw = body_nowait(request.content_length, request.content, cfg.max_body_bytes, limits, loop_of(request))
    if raw is None or len(raw) > OFF_LOOP_BYTES:
        return _read_then_route(request, ctx, chat, limits, raw)
    return _route_parsed(request, ctx, chat, raw, parse_request(raw, chat, limits))


async def _read_then_route(request: web.Request, ctx: RouterContext, chat: bool, limits: RequestLimits,
                           raw: bytes | None) -> web.StreamResponse:
    """:func:`_inference` of a body still arriving (read within the limits first), or of one
    large enough to be parsed off the event loop."""
    cfg = ctx.config
    if raw is None:
        raw = await read_limited_body(request.content_length, request.content, cfg.max_body_bytes,
                                      cfg.body_timeout, limits)
    parsed = (parse_request(raw, chat, limits) if len(raw) <= OFF_LOOP_BYTES
              else await decode_off_loop(raw, parse_request, chat, limits))
    return await _route_parsed(request, ctx, chat, raw, parsed)


def _route_parsed(request: web.Request, ctx: RouterContext, chat: bool, raw: bytes,
                  parsed: CompletionRequest | ChatCompletionRequest) -> Awaitable[web.StreamResponse]:
    """A validated request to a virtual model's handler or, the usual case, to :func:`_route`."""
    # The client's request id, or one made here: returned, passed to the worker, in the access log.
    # (32 random hex digits, as uuid4().hex but without building a UUID)
    request_id = request.headers.get(HEADER_REQUEST_ID)
    request_id = forwardable(HEADER_REQUEST_ID, request_id) if request_id else os.urandom(16).hex()
    virtual = ctx.virtual_models.get(parsed.model)
    if virtual is not None:
        async def forward_to(body: dict, is_chat: bool, stream: bool, include_usage: bool,
                             response_headers: Mapping[str, str]) -> web.StreamResponse:
            data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
            return await forward(request, data, body, is_chat, stream=stream, include_usage=include_usage,
                                 request_id=request_id, response_headers=response_headers)

        return serve_virtual(request, ctx, virtual, parsed, chat, request_id, forward_to)
    served = ctx.registry.models()
    if served and parsed.model not in served:
        raise model_not_found(parsed.model, [*served, *ctx.virtual_models])
    return _route(ctx, request, raw, parsed.body, chat, parsed.stream, parsed.include_usage, request_id, None,
                  served)


@functools.lru_cache(maxsize=8)
def _limits(max_body_bytes: int) -> RequestLimits:
    """The request limits of a body limit (one object, not one per request)."""
    return RequestLimits(max_body_bytes=max_body_bytes)


def forward(request: web.Request, raw: bytes, body: dict, chat: bool, *, stream: bool, include_usage: bool,
            request_id: str, response_headers: Mapping[str, str] | None = None,
            served: Sequence[str] | None = None) -> Awaitable[web.StreamResponse]:
    """Route one validated request (``raw`` is ``body`` as the worker gets it) to a worker of its
    model through the cache-aware proxy, answer with its response, log it and record its usage
    (``served``: the models the workers serve, when the caller has them already). Awaited."""
    ctx = request.app[CONTEXT]
    return _route(ctx, request, raw, body, chat, stream, include_usage, request_id, response_headers,
                  ctx.registry.models() if served is None else served)


async def _route(ctx: RouterContext, request: web.Request, raw: bytes, body: dict, chat: bool, stream: bool,
                 include_usage: bool, request_id: str, response_headers: Mapping[str, str] | None,
                 served: Sequence[str]) -> web.StreamResponse:
    """:func:`forward`'s work."""
    cfg = ctx.config
    path = "/v1/chat/completions" if chat else "/v1/completions"
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    session = session_key_of(request.headers, body, cfg.session_headers, cfg.session_fields)
    try:
        prompt = prompt_key(body, chat, cfg.chunk_size, cfg.ring_key_chunks, session)
    except RenderError as exc:
        raise bad_request(str(exc), exc.param) from None
    if ctx.tokenizers is not None and ctx.balancer.precise.has_backends():
        prompt.tokens = ctx.tokenizers.prompt_tokens(body, chat)
    affinity = parse_affinity(request.headers.get(HEADER_AFFINITY))
    if ctx.prewarmer.top:
        ctx.prewarmer.hot.record(prompt.ring_key, path, model, raw, time.time())
    upstream_body = raw
    if stream and not include_usage:
        upstream_body = with_include_usage(raw, body)
    headers = {"Content-Type": "application/json", HEADER_REQUEST_ID: request_id}
    for name in (*FORWARDED_HEADERS, *cfg.session_headers):
        value = request.headers.get(name)
        if value is not None:
            headers[name] = forwardable(name, value)
    if cfg.worker_api_key:
        headers["Authorization"] = f"Bearer {cfg.worker_api_key}"
    elif cfg.api_keys:
        headers.pop("Authorization", None)  # the client's key is for this router, not the workers
    loop = loop_of(request)
    preq = ProxyRequest(path=path, body=upstream_body, prompt=prompt, stream=stream,
                        client_wants_usage=include_usage, affinity=affinity, headers=headers,
                        exclude=ctx.registry.excluded_for(model), request_id=request_id,
                        response_headers=response_headers or {}, loop=loop)
    started = time.perf_counter()
    status = 500
    try:
        response = await ctx.proxy.handle(request, preq)
        status = response.status
        return response
    except OpenAIError as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        # a model no worker serves is not a label: clients must not grow the metric's series.
        # Logged and counted in the loop's next turn, once the answer has been written: the client
        # does not wait for it (its next request arrives in a later turn and finds it counted).
        loop.call_soon(
            _access, ctx, preq, model, model if model in served else "unknown", status,
            time.perf_counter() - started, request, cfg.api_keys, session)


def tenant_of_request(request: web.Request, api_keys: Sequence[str], session: str | None) -> str:
    """Who a request is billed to: its API key (a digest) when the router checks keys, else its
    session key (``router.cost.ledger.tenant_of``)."""
    key = bearer_token(request.headers.get("Authorization")) if api_keys else None
    return tenant_of(key.decode("utf-8", "surrogatepass") if key else None, session)


def _access(ctx: RouterContext, preq: ProxyRequest, model: str, label: str, status: int,
            duration_s: float, request: web.Request, api_keys: Sequence[str], session: str | None) -> None:
    """One access-log line per request, the router's own latency histograms (by model: they
    hold for every kind of backend, vLLM's included), and the answer's usage in the ledger
    (billed to :func:`tenant_of_request`)."""
    booking = preq.booking
    usage = booking.usage if booking is not None else None  # (read once: the answer parsed here)
    if status == 200 and usage is not None:
        ctx.costs.record(model, tenant_of_request(request, api_keys, session), usage)
    ctx.metrics.observe_request(label, preq.ttfb_s, duration_s)
    if not access_log.isEnabledFor(logging.INFO):
        return
    numbers = usage_numbers(usage)
    log_info(access_log, "event=access request_id=%s model=%s path=%s stream=%s status=%d worker=%s reason=%s "
             "attempts=%d ttfb_ms=%s duration_ms=%.1f prompt_tokens=%s cached_tokens=%s "
             "predicted_cached_tokens=%d", preq.request_id, model, preq.path, preq.stream, status, preq.worker,
             preq.reason, preq.attempts, "-" if preq.ttfb_s is None else f"{1000 * preq.ttfb_s:.1f}",
             1000 * duration_s, numbers[0] if numbers else "-",
             numbers[1] if numbers and numbers[1] is not None else "-", preq.predicted_cached_tokens)


# The fast front's handlers (router/http/front.py): _inference itself, one coroutine less a request.
FAST_ROUTES = {"/v1/completions": functools.partial(_inference, chat=False),
               "/v1/chat/completions": functools.partial(_inference, chat=True)}


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _inference(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _inference(request, chat=True)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the union of the healthy workers' models, then the router's virtual
    models (``route`` / ``cascade``, with the real models they resolve to)."""
    ctx = request.app[CONTEXT]
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "prefixlb"} for m in ctx.registry.models()
            if m not in ctx.virtual_models]
    data += [{"id": name, "object": "model", "created": 0, "owned_by": "prefixlb", "prefixlb": describe_virtual(vm)}
             for name, vm in sorted(ctx.virtual_models.items())]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """``GET /health``: the router is up; says how many workers it can route to."""
    ctx = request.app[CONTEXT]
    routable = len(ctx.balancer.routable())
    # 200 either way (a liveness probe must not restart a router whose workers are down), but
    # the status says when it cannot route anything.
    status = "ok" if routable or not len(ctx.registry) else "no_routable_workers"
    stalled = ctx.state.stalled() if ctx.state else []
    if stalled:
        # A background loop is stuck (not failing: stuck): this router's view of the fleet is
        # frozen. 503, so that an orchestrator restarts it.
        return web.json_response({"status": "loop_stalled", "stalled_loops": stalled, "routable_workers": routable,
                                  "known_workers": len(ctx.registry), "redis": ctx.state.status()}, status=503)
    return web.json_response({"status": status, "routable_workers": routable, "known_workers": len(ctx.registry),
                              "redis": ctx.state.status() if ctx.state else "disabled"})


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: readiness, apart from liveness (``/health``): 200 only while this router can
    route (a routable worker, no stuck loop), so a load balancer sends it traffic only then."""
    ctx = request.app[CONTEXT]
    routable = len(ctx.balancer.routable())
    stalled = ctx.state.stalled() if ctx.state else []
    if stalled:
        return web.json_response({"status": "loop_stalled", "stalled_loops": stalled}, status=503)
    if not routable:
        return web.json_response({"status": "no_routable_workers", "known_workers": len(ctx.registry)}, status=503)
    return web.json_response({"status": "ready", "routable_workers": routable})


async def version_info(request: web.Request) -> web.Response:
    """``GET /version``."""
    return web.json_response({"version": version()})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus exposition format."""
    ctx = request.app[CONTEXT]
    if ctx.siblings is None:
        return await own_metrics(request)
    # --processes N: one view of them all (router/http/siblings.py)
    theirs = await ctx.siblings.gather("GET", "/metrics")
    texts = [(ctx.siblings.slot.index, ctx.metrics.render().decode())]
    texts += [(i, body.decode()) for i, status, body in theirs if status == 200]
    body = merge_metrics(sorted(texts), ctx.siblings.slot.count)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def own_metrics(request: web.Request) -> web.Response:
    """``GET /metrics`` on a control socket: this process's metrics alone."""
    return web.Response(body=request.app[CONTEXT].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    """Register the OpenAI and operations routes."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/version", version_info)
    app.router.add_get("/metrics", metrics)
