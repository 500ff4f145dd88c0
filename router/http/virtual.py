"""Virtual models on the request path: a ``route`` or ``cascade`` request resolved to real models.

The API hands a request naming a virtual model here, with ``forward``: "send this body to its
model through the cache-aware proxy" (``router/http/api.py``'s :func:`forward`: the model's
pool, the normal policy, retries, the access log and the ledger). So every real call a virtual
model makes is routed, logged and priced like a plain request.

- ``route``: the resolver picks one model (rules, then the classifier's score, then the
  default); the request goes there with ``model`` rewritten, streamed straight through when the
  client streams. Headers: ``X-Prefixlb-Virtual-Model``, ``X-Prefixlb-Answered-By``,
  ``X-Prefixlb-Route-Decision`` (``rule:<i>``, ``classifier:above|below``,
  ``classifier_error:<why>``, ``default``), ``X-Prefixlb-Route-Score`` when the classifier
  scored it, and ``X-Prefixlb-Cost-USD`` on a priced non-streamed answer.
- ``cascade``: :class:`~router.virtual_models.cascade.CascadeRunner` with a ``send`` that
  forwards each stage's (non-streamed) request; the accepted answer is returned whole, or, to a
  streaming client, as SSE events once judged (no byte of a rejected answer is ever written:
  the response is not even prepared before the cascade ends). ``X-Prefixlb-Max-Escalations``
  lowers the cascade's cap for one request.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web

from protocol import untrusted_json
from protocol.openai_api import SERVER_ERROR, SERVICE_UNAVAILABLE, OpenAIError, bad_request
from router.context import RouterContext
from router.cost.pricing import usage_from_openai
from router.http.proxy import HEADER_WORKER
from router.virtual_models.answer import StageAnswer, StageError
from router.virtual_models.cascade import CascadeFailed, CascadeRequestError, CascadeRunner
from router.virtual_models.classifier import RouteClassifier, resolve_route
from router.virtual_models.config import CascadeModel, RouteModel
from router.virtual_models.judges.build import JudgeRuntime
from router.virtual_models.stream import sse_events
from router.http.front import WHOLE_RESPONSES, stream_response

HEADER_VIRTUAL = "X-Prefixlb-Virtual-Model"
HEADER_ANSWERED_BY = "X-Prefixlb-Answered-By"
HEADER_ROUTE_DECISION = "X-Prefixlb-Route-Decision"
HEADER_ROUTE_SCORE = "X-Prefixlb-Route-Score"
HEADER_MAX_ESCALATIONS = "X-Prefixlb-Max-Escalations"
HEADER_COST = "X-Prefixlb-Cost-USD"

Forward = Callable[[dict, bool, bool, bool, Mapping[str, str]], Awaitable[web.StreamResponse]]
"""``await forward(body, chat, stream, include_usage, response_headers)``: the answer of
``body["model"]``'s pool (raises ``OpenAIError`` when no worker could answer)."""


def describe_virtual(vm: RouteModel | CascadeModel) -> dict[str, Any]:
    """What ``GET /v1/models`` tells of a virtual model: its kind and the real models behind it."""
    if isinstance(vm, CascadeModel):
        return {"kind": "cascade", "stages": [s.model for s in vm.stages], "max_escalations": vm.max_escalations}
    models = [vm.default, *(r.model for r in vm.rules)]
    if vm.classifier is not None:
        models += [vm.classifier.above, vm.classifier.below]
    return {"kind": "route", "models": sorted(set(models))}


async def serve_virtual(request: web.Request, ctx: RouterContext, vm: RouteModel | CascadeModel, parsed: Any,
                        chat: bool, request_id: str, forward: Forward) -> web.StreamResponse:
    """Answer ``parsed`` (a validated request naming ``vm``) through ``vm``'s real models."""
    if isinstance(vm, RouteModel):
        return await _serve_route(request, ctx, vm, parsed, chat, forward)
    return await _serve_cascade(request, ctx, vm, parsed, chat, request_id, forward)


def scoring_session(ctx: RouterContext) -> aiohttp.ClientSession:
    """The session of classifiers and verifiers: not the workers' pool, which passes bodies
    through undecoded (a scoring service may compress its reply) and carries no deadline of
    its own (each scoring call has its ``timeout_s``)."""
    if ctx.scoring_session is None or ctx.scoring_session.closed:
        ctx.scoring_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=75.0))
    return ctx.scoring_session


def _unserved(ctx: RouterContext, model: str) -> bool:
    served = ctx.registry.models()
    return bool(served) and model not in served


async def _serve_route(request: web.Request, ctx: RouterContext, vm: RouteModel, parsed: Any, chat: bool,
                       forward: Forward) -> web.StreamResponse:
    classifier = RouteClassifier(vm.classifier, session=scoring_session(ctx)) if vm.classifier else None
    decision = await resolve_route(vm, parsed.body, chat, request.headers, classifier)
    ctx.virtual_metrics.route_decisions.labels(vm.name, decision.model, decision.reason).inc()
    if _unserved(ctx, decision.model):
        ctx.virtual_metrics.failed.labels(vm.name, "no_workers").inc()
        raise OpenAIError(503, f"{vm.name} routes this request to {decision.model!r}, which no healthy worker "
                               "serves", SERVICE_UNAVAILABLE, None, "no_workers")
    headers = {HEADER_VIRTUAL: vm.name, HEADER_ANSWERED_BY: decision.model, HEADER_ROUTE_DECISION: decision.reason}
    if decision.score is not None:
        headers[HEADER_ROUTE_SCORE] = f"{decision.score:.6g}"
    body = {**parsed.body, "model": decision.model}
    response = await forward(body, chat, parsed.stream, parsed.include_usage, headers)
    if response.status == 200:
        ctx.virtual_metrics.answered.labels(vm.name, decision.model).inc()
        if isinstance(response, WHOLE_RESPONSES):  # a whole answer, not yet sent: its cost can still be a header
            cost = _answer_cost(ctx, decision.model, response.body)
            if cost is not None:
                response.headers[HEADER_COST] = f"{cost:.9f}"
                ctx.virtual_metrics.cost.labels(vm.name).inc(cost)
    return response


def _answer_cost(ctx: RouterContext, model: str, raw: Any) -> float | None:
    """The price of a JSON answer's ``usage`` (None: no usage, or a model the book does not list)."""
    try:
        usage = untrusted_json.loads(raw).get("usage") if isinstance(raw, (bytes, bytearray)) else None
    except (ValueError, AttributeError):
        return None
    if not isinstance(usage, Mapping):
        return None
    priced = ctx.costs.price(model, usage_from_openai(usage))
    return None if priced is None else priced.total_usd


def parse_max_escalations(value: str | None) -> int | None:
    """The ``X-Prefixlb-Max-Escalations`` header: an integer >= 0 (None when absent), else a 400."""
    if value is None:
        return None
    try:
        cap = int(value)
    except ValueError:
        cap = -1
    if cap < 0:
        raise bad_request(f"{HEADER_MAX_ESCALATIONS} must be an integer >= 0", HEADER_MAX_ESCALATIONS)
    return cap


def stage_sender(ctx: RouterContext, forward: Forward) -> Callable[[str, dict], Awaitable[StageAnswer]]:
    """The cascade's ``send``: a stage's (or an LLM judge's) request through ``forward``, its
    answer buffered whole; upstream failures become :class:`StageError` (retryable: 5xx)."""

    async def send(model: str, body: dict) -> StageAnswer:
        if _unserved(ctx, model):
            raise StageError(f"no healthy worker serves model {model!r}", 503, retryable=True)
        try:
            response = await forward(body, "messages" in body, False, False, {})
        except OpenAIError as exc:
            raise StageError(exc.message, exc.status, exc.status >= 500, exc.body()) from None
        raw = response.body if isinstance(response, WHOLE_RESPONSES) else None
        try:
            data = untrusted_json.loads(raw) if isinstance(raw, (bytes, bytearray)) else None
        except ValueError:
            data = None
        if response.status != 200 or not isinstance(data, dict):
            message = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
            raise StageError(message or f"{model} answered HTTP {response.status}", response.status,
                             response.status >= 500 or response.status == 200, data if isinstance(data, dict) else None)
        return StageAnswer(model, data, response.headers.get(HEADER_WORKER))

    return send


def _failure(exc: CascadeFailed) -> OpenAIError:
    """The client's error for a cascade no stage could answer."""
    error = (exc.body or {}).get("error") if isinstance(exc.body, Mapping) else None
    if isinstance(error, Mapping) and 400 <= exc.status < 500:  # a stage refused the request itself
        return OpenAIError(exc.status, str(error.get("message") or exc), str(error.get("type") or "invalid_request_error"),
                           error.get("param") if isinstance(error.get("param"), str) else None,
                           error.get("code") if isinstance(error.get("code"), str) else exc.code)
    kind = SERVICE_UNAVAILABLE if exc.status == 503 else SERVER_ERROR
    return OpenAIError(exc.status if exc.status >= 400 else 502, str(exc), kind, None, exc.code)


async def _serve_cascade(request: web.Request, ctx: RouterContext, vm: CascadeModel, parsed: Any, chat: bool,
                         request_id: str, forward: Forward) -> web.StreamResponse:
    cap = parse_max_escalations(request.headers.get(HEADER_MAX_ESCALATIONS))
    send = stage_sender(ctx, forward)
    book = ctx.costs.price_book
    runner = CascadeRunner.build(vm, send, JudgeRuntime(send=send, session=scoring_session(ctx),
                                                        price_book=book), book)
    try:
        result = await runner.run(parsed.body, chat, cap)
    except CascadeRequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    except CascadeFailed as exc:
        ctx.virtual_metrics.observe_stages(vm.name, exc.stages)
        ctx.virtual_metrics.failed.labels(vm.name, exc.code).inc()
        raise _failure(exc) from None
    ctx.virtual_metrics.observe_result(result)
    headers = {**result.headers(), HEADER_VIRTUAL: vm.name, "X-Request-Id": request_id}
    if not parsed.stream:
        return web.json_response(result.body, headers=headers)
    response = stream_response(request, 200, {**headers, "Content-Type": "text/event-stream",
                                              "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in sse_events(result.body, chat, parsed.include_usage):
        await response.write(event)
    await response.write_eof()
    return response
