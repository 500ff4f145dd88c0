"""``POST /v1/completions``, ``POST /v1/chat/completions`` (whole or SSE) and ``GET /v1/models``."""
from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from aiohttp import web

from protocol.openai_api import (SERVICE_UNAVAILABLE, OpenAIError, parse_chat_request,
                                 parse_completion_request)
from worker.server.api.body import read_json
from worker.server.api.context import CTX, WorkerContext
from worker.server.api.errors import CACHED_CPU_HEADER, CACHED_GPU_HEADER, WORKER_HEADER, map_exception
from worker.server.api.generation import PreparedRequest, prepare, run_choices, tool_parser_for
from worker.server.api.responses import (ChoiceState, ResponseMeta, chat_logprobs, completion_logprobs,
                                  full_response, stream_chunk, tool_calls_chunk, tool_finish_reason, usage,
                                  usage_chunk)
from worker.server.api.tool_calls import ToolCallStream

log = logging.getLogger("prefixlb.worker.server")


def _sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI completions."""
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions."""
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    ctx = request.app[CTX]
    if ctx.draining:
        raise OpenAIError(503, "This worker is draining and takes no new requests",
                          SERVICE_UNAVAILABLE, code="draining")
    body = await read_json(request, ctx.limits, ctx.body_timeout)
    req = parse_chat_request(body, ctx.limits) if chat else parse_completion_request(body, ctx.limits)
    prep = prepare(ctx, req)
    meta = ResponseMeta(ctx.new_request_id("chatcmpl" if chat else "cmpl"), req.model,
                        ctx.worker_id, chat)
    ctx.request_started()
    try:
        if req.stream:
            return await _stream(request, ctx, prep, meta)
        return await _whole(ctx, prep, meta)
    finally:
        ctx.request_finished()


def _check_finish(reason: str | None) -> None:
    if reason == "abort":
        raise OpenAIError(503, "The request was aborted by the engine", SERVICE_UNAVAILABLE, code="aborted")


async def _whole(ctx: WorkerContext, prep: PreparedRequest, meta: ResponseMeta) -> web.Response:
    states = [ChoiceState(i) for i in range(len(prep.params))]
    prompt_tokens = cached = loaded = 0
    async with contextlib.aclosing(run_choices(ctx, meta.id, prep)) as outputs:
        async for index, out in outputs:
            st = states[index]
            st.text += out.new_text
            st.num_tokens = len(out.token_ids)
            if out.logprobs:
                st.logprobs.extend(out.logprobs)
            if index == 0:
                prompt_tokens, cached, loaded = out.num_prompt_tokens, out.num_cached_tokens, out.num_loaded_tokens
            if out.finished:
                _check_finish(out.finish_reason)
                st.finish_reason = out.finish_reason
    use = usage(prompt_tokens, sum(s.num_tokens for s in states), cached)
    ctx.metrics.count_cached(cached, loaded)
    body = full_response(meta, ctx.tokenizer, states, prep.params[0].logprobs, use,
                         tool_parser_for(ctx, prep.request))
    return web.json_response(body, dumps=lambda o: json.dumps(o, ensure_ascii=False),
                             headers=_cached_split(cached, loaded))


def _cached_split(cached: int, loaded: int) -> dict[str, str]:
    """The headers splitting ``cached_tokens``: GPU prefix-cache hit and CPU-tier load."""
    return {CACHED_GPU_HEADER: str(cached - loaded), CACHED_CPU_HEADER: str(loaded)}


async def _stream(request: web.Request, ctx: WorkerContext, prep: PreparedRequest,
                  meta: ResponseMeta) -> web.StreamResponse:
    req = prep.request
    top_k = prep.params[0].logprobs
    n = len(prep.params)
    offsets = [0] * n
    tokens = [0] * n
    prompt_tokens = cached = loaded = 0
    parser = tool_parser_for(ctx, req)
    # With a tool-call parser, text that may be a call is held back until the answer ends.
    calls_held = [ToolCallStream(parser) if parser is not None else None for _ in range(n)]
    async with contextlib.aclosing(run_choices(ctx, meta.id, prep)) as outputs:
        # The first output decides between an HTTP error (nothing sent yet) and a stream.
        first = await outputs.__anext__()
        # The first output comes after the request's first scheduling: its cache split is known.
        out0 = first[1]
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", WORKER_HEADER: ctx.worker_id,
            **_cached_split(out0.num_cached_tokens, out0.num_loaded_tokens)})
        await resp.prepare(request)
        try:
            if meta.chat:
                for i in range(n):
                    await resp.write(_sse(stream_chunk(meta, i, "", None, None, req.include_usage, first=True)))
            pending = [first]
            while True:
                for index, out in pending:
                    if index == 0:
                        prompt_tokens, cached = out.num_prompt_tokens, out.num_cached_tokens
                        loaded = out.num_loaded_tokens
                    tokens[index] = len(out.token_ids)
                    if out.finished:
                        _check_finish(out.finish_reason)
                    lp = None
                    if top_k is not None and out.logprobs:
                        lp = (chat_logprobs(ctx.tokenizer, out.logprobs, top_k) if meta.chat
                              else completion_logprobs(ctx.tokenizer, out.logprobs, top_k, offsets[index]))
                    offsets[index] += len(out.new_text)
                    text, finish = out.new_text, out.finish_reason
                    held = calls_held[index]
                    if held is not None:
                        text = held.add(text)
                        if out.finished:
                            rest, calls = held.finish()
                            text += rest
                            if calls:
                                if text or lp is not None:
                                    await resp.write(_sse(stream_chunk(meta, index, text, None, lp,
                                                                       req.include_usage)))
                                    text, lp = "", None
                                await resp.write(_sse(tool_calls_chunk(meta, index, calls, req.include_usage)))
                                finish = tool_finish_reason(finish, calls)
                    if text or out.finished or lp is not None:
                        await resp.write(_sse(stream_chunk(meta, index, text, finish, lp, req.include_usage)))
                try:
                    pending = [await outputs.__anext__()]
                except StopAsyncIteration:
                    break
            use = usage(prompt_tokens, sum(tokens), cached)
            ctx.metrics.count_cached(cached, loaded)
            if req.include_usage:
                await resp.write(_sse(usage_chunk(meta, use)))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            log.info("event=client_disconnected request=%s", meta.id)  # closing `outputs` aborts
            return resp
        except Exception as exc:  # after the first byte: tell the client in-stream, then end
            err = map_exception(exc)
            status = err.status
            if status >= 500:
                log.error("event=stream_failed request=%s status=%d error=%r", meta.id, status, exc)
            ctx.metrics.errors.labels(str(status)).inc()
            with contextlib.suppress(ConnectionError):
                await resp.write(_sse(err.body()))
                await resp.write(b"data: [DONE]\n\n")
            return resp
    return resp


async def models(request: web.Request) -> web.Response:
    """The served model, then every LoRA adapter with ``parent`` = the base model (vLLM's shape)."""
    ctx = request.app[CTX]
    created = int(ctx.started_at)
    data = [{"id": ctx.model_name, "object": "model", "created": created, "owned_by": "prefixlb",
             "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len}]
    data += [{"id": a.name, "object": "model", "created": created, "owned_by": "prefixlb", "root": a.path,
              "parent": ctx.model_name, "max_model_len": ctx.max_model_len} for a in ctx.loras]
    return web.json_response({"object": "list", "data": data})
