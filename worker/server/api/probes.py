"""Operational endpoints and the probes other routers send to a worker.

Ours: ``GET /health`` (503 while draining), ``GET /load`` (a protocol.LoadReport),
``GET /metrics``. SGLang-router's: ``/health_generate``, ``/get_server_info`` and
``/server_info`` (``dp_size``, ``model_id``, limits — and deliberately no ``model_path``: with
one, sglang-router tries to download a tokenizer), ``/get_model_info`` and ``/model_info``,
``/get_load`` (one entry per data-parallel rank: ``num_reqs``, ``num_waiting_reqs``,
``num_tokens``). vLLM's: ``/tokenize``, ``/detokenize``, ``/v1/completions/render`` (a list with
one ``{token_ids, ...}`` per prompt) and ``/v1/chat/completions/render`` (one object).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict

from aiohttp import web

from protocol.openai_api import (SERVICE_UNAVAILABLE, ChatCompletionRequest, OpenAIError, bad_request,
                                 error_body, parse_chat_request, parse_completion_request)
from worker.server.api.body import read_json
from worker.server.api.context import CTX, WorkerContext
from worker.server.api.generation import prepare, prompt_token_ids, resolve_lora
from worker.server.metrics import CONTENT_TYPE
from worker.engine.sampling_params import SamplingParams

VERSION = "prefixlb-0.1.0"


def _draining(ctx: WorkerContext) -> web.Response:
    return web.json_response({**error_body("This worker is draining", SERVICE_UNAVAILABLE, code="draining"),
                              "status": "draining"}, status=503)


async def health(request: web.Request) -> web.Response:
    """200 while serving (with the Redis connection's state), 503 while draining."""
    ctx = request.app[CTX]
    if ctx.draining:
        return _draining(ctx)
    if not ctx.engine.is_running:
        raise OpenAIError(503, "The engine is not running", SERVICE_UNAVAILABLE, code="engine_dead")
    return web.json_response({"status": "ready", "worker_id": ctx.worker_id, "redis": _redis_state(ctx)})


def _redis_state(ctx: WorkerContext) -> dict:
    """``off`` without ``--redis``; else ``connected`` or ``unreachable`` with the last error.
    Redis down degrades routing, never serving: /health stays 200."""
    if ctx.publisher is None:
        return {"state": "off"}
    stats = ctx.publisher.stats
    state = "connected" if stats.connected else "unreachable"
    return {"state": state, "last_error": stats.last_error}


async def health_generate(request: web.Request) -> web.Response:
    """Generate one token through the whole engine; 200 when it works."""
    ctx = request.app[CTX]
    if ctx.draining:
        return _draining(ctx)
    ids = ctx.tokenizer.encode("ping", add_bos=True)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rid = ctx.new_request_id("health")
    async with contextlib.aclosing(ctx.engine.generate(rid, ids, params, namespace=0)) as outs:
        async for out in outs:
            if out.finished:
                break
    return web.json_response({"status": "ok", "worker_id": ctx.worker_id})


async def load(request: web.Request) -> web.Response:
    """This worker's LoadReport."""
    return web.json_response(request.app[CTX].load_report().to_dict())


async def get_load(request: web.Request) -> web.Response:
    """SGLang's load shape: one entry per data-parallel rank (we have one)."""
    s = request.app[CTX].engine.stats()
    return web.json_response([{
        "dp_rank": 0, "num_reqs": s.running + s.waiting, "num_waiting_reqs": s.waiting,
        "num_tokens": s.running_tokens + s.queued_prefill_tokens,
        "num_pending_tokens": s.queued_prefill_tokens}])


def _server_info(ctx: WorkerContext) -> dict:
    s = ctx.engine.stats()
    return {
        "model_id": ctx.model_name, "served_model_name": ctx.model_name, "worker_id": ctx.worker_id,
        "status": ctx.status, "version": VERSION, "dp_size": 1,
        "tp_size": int(ctx.info_extra.get("tp_size", 1)), "page_size": s.block_size,
        "context_length": ctx.max_model_len, "max_total_num_tokens": s.capacity_tokens,
        "max_running_requests": s.max_num_seqs, "max_prefill_tokens": s.max_num_batched_tokens,
        "chunked_prefill_size": s.max_num_batched_tokens, "simulated": ctx.simulated,
        **{k: v for k, v in ctx.info_extra.items() if k != "tp_size"},
        "internal_states": [{"load": ctx.load_report().to_dict()}],
    }


async def server_info(request: web.Request) -> web.Response:
    """Server limits and identity, without ``model_path``."""
    return web.json_response(_server_info(request.app[CTX]))


async def model_info(request: web.Request) -> web.Response:
    """Model identity, without ``model_path`` or ``tokenizer_path``."""
    ctx = request.app[CTX]
    return web.json_response({
        "model_id": ctx.model_name, "served_model_name": ctx.model_name, "is_generation": True,
        "max_context_length": ctx.max_model_len, "vocab_size": ctx.engine.engine.vocab_size,
        "weight_version": "default", "simulated": ctx.simulated})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition."""
    body = request.app[CTX].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _model_or_default(ctx: WorkerContext, body: dict) -> dict:
    return body if "model" in body else {**body, "model": ctx.model_name}


async def tokenize(request: web.Request) -> web.Response:
    """vLLM/SGLang ``/tokenize``: ``{prompt}`` or ``{messages}`` to ``{count, max_model_len, tokens}``."""
    ctx = request.app[CTX]
    body = _model_or_default(ctx, await read_json(request, ctx.limits, ctx.body_timeout))
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
    req = parse_chat_request(body, ctx.limits) if "messages" in body else parse_completion_request(body, ctx.limits)
    resolve_lora(ctx, req)  # the base model or a loaded adapter (same tokenizer)
    if isinstance(req, ChatCompletionRequest):
        ids = prompt_token_ids(ctx, req)
    elif isinstance(req.prompt, list):
        raise bad_request("'prompt' must be a string", "prompt")
    else:
        ids = ctx.tokenizer.encode(req.prompt, add_bos=add_special)
    return web.json_response({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
                              "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    """``{tokens}`` to ``{prompt}``."""
    ctx = request.app[CTX]
    body = await read_json(request, ctx.limits, ctx.body_timeout)
    tokens = body.get("tokens")
    vocab = ctx.engine.engine.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               and 0 <= t < vocab for t in tokens):
        raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    return web.json_response({"prompt": ctx.tokenizer.decode(tokens)})


def _rendered(ctx: WorkerContext, body: dict, chat: bool) -> dict:
    req = parse_chat_request(body, ctx.limits) if chat else parse_completion_request(body, ctx.limits)
    prep = prepare(ctx, req)
    return {"request_id": ctx.new_request_id("chatcmpl" if chat else "cmpl"), "model": req.model,
            "token_ids": prep.prompt_token_ids, "sampling_params": asdict(prep.params[0])}


async def render_completion(request: web.Request) -> web.Response:
    """vLLM ``/v1/completions/render``: the prompt's token ids, without generating."""
    ctx = request.app[CTX]
    return web.json_response([_rendered(ctx, await read_json(request, ctx.limits, ctx.body_timeout), chat=False)])


async def render_chat(request: web.Request) -> web.Response:
    """vLLM ``/v1/chat/completions/render``: the chat prompt's token ids, without generating."""
    ctx = request.app[CTX]
    return web.json_response(_rendered(ctx, await read_json(request, ctx.limits, ctx.body_timeout), chat=True))
