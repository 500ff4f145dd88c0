"""From a validated OpenAI request to engine requests, and from engine outputs back.

:func:`prepare` checks what only the worker can check (served model or LoRA adapter, context
length, vocabulary, text-only content), tokenizes, and builds one SamplingParams per choice.
:func:`run_choices` runs the ``n`` choices as engine requests and yields their outputs as
they come; closing it aborts whatever still runs, so a client that goes away frees its
KV blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator

from protocol.hashing import namespace_seed
from protocol.openai_api import (ChatCompletionRequest, CompletionRequest, bad_request,
                                 model_not_found)
from protocol.render import RenderError, render_request
from worker.server.api.context import WorkerContext
from worker.server.api.tool_calls import ToolCallParser
from worker.engine.errors import InvalidRequestError
from worker.engine.kv_cache.hashing import adapter_namespace
from worker.engine.lora.adapter import LoRAAdapter
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams

SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class PreparedRequest:
    """Everything the engine needs for one OpenAI request.

    ``namespace`` seeds the router's chunk chain (the request's model, ``lora_adapter`` and
    ``cache_salt``, as the router computes it); ``engine_namespace`` is what the engine's block
    chain starts from (the base model's namespace; the engine mixes ``lora``'s identity in).
    """

    request: CompletionRequest | ChatCompletionRequest
    prompt_token_ids: list[int]
    params: list[SamplingParams]
    namespace: int
    rendered: bytes
    lora: LoRAAdapter | None = None
    engine_namespace: int = 0

    @property
    def block_namespace(self) -> int:
        """The seed of the engine's block hashes of this request."""
        return adapter_namespace(self.engine_namespace, self.lora.identity if self.lora else None)


def _chat_token_ids(ctx: WorkerContext, req: ChatCompletionRequest) -> list[int]:
    for i, m in enumerate(req.messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type", "text") != "text":
                    raise bad_request(f"content part type {part.get('type')!r} is not supported: "
                                      f"{ctx.model_name} accepts text only",
                                      f"messages[{i}].content[{j}].type", "unsupported")
    try:
        return ctx.tokenizer.encode_chat(req.messages, req.tools, add_generation_prompt=True,
                                         template_kwargs=req.chat_template_kwargs)
    except InvalidRequestError as exc:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "messages"
        raise bad_request(str(exc), param) from None


# Fields vLLM or OpenAI honour that this worker cannot, with the values that ask for nothing. A
# request that sets one otherwise is refused (400 "unsupported"), never served as if it had not.
UNHONOURED_FIELDS: dict[str, tuple[object, ...]] = {
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "prompt_logprobs": (None,), "prediction": (None,), "audio": (None,),
}
UNHONOURED_CHAT_FIELDS: dict[str, tuple[object, ...]] = {
    "functions": (None,), "function_call": (None, "none"), "chat_template": (None,),
    "continue_final_message": (None, False), "add_generation_prompt": (None, True), "documents": (None,),
    "modalities": (None, ["text"]), "parallel_tool_calls": (None, True),
}


def check_unhonoured_fields(ctx: WorkerContext, req: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for a field this worker would otherwise ignore although it changes the answer."""
    fields = {**UNHONOURED_FIELDS, **UNHONOURED_CHAT_FIELDS} if req.chat else UNHONOURED_FIELDS
    for name, neutral in fields.items():
        if name in req.body and req.body[name] not in neutral:
            raise bad_request(f"'{name}' is not supported by {ctx.model_name} on this worker", name, "unsupported")


def check_tool_choice(ctx: WorkerContext, req: ChatCompletionRequest) -> None:
    """vLLM's rule: tools the model may call (``tool_choice`` auto, the default with tools) need
    a ``--tool-call-parser`` to turn its text into ``tool_calls``; else 400, never a silent
    answer without calls."""
    if req.tools and req.tool_choice != "none" and ctx.tool_parser is None:
        raise bad_request(f"\"{req.tool_choice}\" tool choice requires the worker to run with --tool-call-parser; "
                          "send \"tool_choice\": \"none\" to give the model the tools without calls",
                          "tool_choice", "unsupported")


def tool_parser_for(ctx: WorkerContext, req: CompletionRequest | ChatCompletionRequest) -> ToolCallParser | None:
    """The parser to read ``req``'s answers with: the worker's, for a chat whose tools the model
    may call; None otherwise (the answer is content only)."""
    if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice != "none":
        return ctx.tool_parser
    return None


def prompt_token_ids(ctx: WorkerContext, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """Tokenize the request's prompt (chat: through the chat template, as transformers'
    ``apply_chat_template(tokenize=True)``); BOS as the model wants."""
    if isinstance(req, ChatCompletionRequest):
        return _chat_token_ids(ctx, req)
    if isinstance(req.prompt, str):
        return ctx.tokenizer.encode(req.prompt, add_bos=True)
    vocab = ctx.engine.engine.vocab_size
    bad = next((t for t in req.prompt if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    return list(req.prompt)


def resolve_lora(ctx: WorkerContext, req: CompletionRequest | ChatCompletionRequest) -> LoRAAdapter | None:
    """The adapter ``req`` runs with: ``"model": NAME`` (vLLM's convention) or ``lora_adapter``
    with the base model; None for the base model. 404 / 400 otherwise."""
    lora = None
    if req.model != ctx.model_name:
        lora = ctx.find_lora(req.model)
        if lora is None:
            raise model_not_found(req.model, ctx.served_models())
    if req.lora_adapter:
        named = ctx.find_lora(req.lora_adapter)
        if named is None or (lora is not None and named is not lora):
            served = ", ".join(a.name for a in ctx.loras) or "none"
            raise bad_request(f"LoRA adapter {req.lora_adapter!r} is not loaded on this worker "
                              f"(loaded: {served})", "lora_adapter", "adapter_not_found")
        lora = named
    return lora


def prepare(ctx: WorkerContext, req: CompletionRequest | ChatCompletionRequest) -> PreparedRequest:
    """Validate against this worker and build the engine's view of ``req`` (or raise 4xx)."""
    lora = resolve_lora(ctx, req)
    check_unhonoured_fields(ctx, req)
    if isinstance(req, ChatCompletionRequest):
        check_tool_choice(ctx, req)
    try:
        rendered = render_request(req.body, req.chat)
    except RenderError as exc:
        raise bad_request(str(exc), exc.param) from None
    ids = prompt_token_ids(ctx, req)
    if ctx.recorded is not None and ctx.recorded.find(ctx.tokenizer.decode(ids)) is None:
        raise bad_request(f"{ctx.model_name} replays recorded answers and has none for this prompt (its question "
                          "must be the completion prompt or the last user message, exactly)",
                          "messages" if req.chat else "prompt", "prompt_not_recorded")
    limit = ctx.max_model_len
    param = "messages" if req.chat else "prompt"
    s = req.sampling
    if len(ids) >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                          f"{len(ids)} tokens and at least one must be generated", param,
                          "context_length_exceeded")
    max_tokens = s.max_tokens if s.max_tokens is not None else limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                          f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                          f"for the completion)", "max_tokens", "context_length_exceeded")
    params = []
    for i in range(s.n):
        seed = None if s.seed is None else (s.seed + i) & SEED_MASK
        try:
            params.append(SamplingParams(
                max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                seed=seed, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                ignore_eos=s.ignore_eos, logprobs=s.logprobs))
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None
    namespace = ctx.namespace(req.model, req.lora_adapter, req.cache_salt)
    engine_namespace = namespace_seed(ctx.model_name, None, req.cache_salt) if lora is not None else namespace
    return PreparedRequest(req, ids, params, namespace, rendered, lora, engine_namespace)


async def _one(ctx: WorkerContext, rid: str, prep: PreparedRequest, index: int,
               queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(ctx.engine.generate(
                rid, prep.prompt_token_ids, prep.params[index], namespace=prep.engine_namespace,
                lora=prep.lora)) as outs:
            async for out in outs:
                queue.put_nowait((index, out))
    except Exception as exc:  # delivered to the consumer, which maps it at the HTTP edge
        queue.put_nowait((index, exc))


async def run_choices(ctx: WorkerContext, request_id: str, prep: PreparedRequest
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(choice index, output)`` until every choice has finished.

    Engine errors are raised to the caller; closing the iterator early aborts every choice. A
    LoRA adapter whose weights left host memory is read back here, off the engine thread.
    """
    if prep.lora is not None:
        await ctx.prefetch_lora(prep.lora)
    ctx.track_prompt(prep.rendered, prep.prompt_token_ids, prep.namespace, prep.block_namespace,
                     prep.lora.name if prep.lora else None)
    n = len(prep.params)
    if n == 1:
        async with contextlib.aclosing(ctx.engine.generate(
                request_id, prep.prompt_token_ids, prep.params[0], namespace=prep.engine_namespace,
                lora=prep.lora)) as outs:
            async for out in outs:
                observe(ctx, out, prep)
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_one(ctx, f"{request_id}-{i}", prep, i, queue)) for i in range(n)]
    remaining = n
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            observe(ctx, item, prep)
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def observe(ctx: WorkerContext, out: RequestOutput, prep: PreparedRequest) -> None:
    """Feed one output's timings into the latency histograms."""
    m = ctx.metrics
    if out.ttft_s is not None:
        m.ttft.observe(out.ttft_s)
    for gap in out.itl_s:
        m.itl.observe(gap)
    if out.finished:
        m.e2e.observe(max(0.0, time.monotonic() - out.arrival_time))
        m.requests.labels("chat" if prep.request.chat else "completions", out.finish_reason or "").inc()
