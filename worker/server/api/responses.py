"""OpenAI response bodies: completions and chat, whole or as stream chunks, usage and logprobs.

Pure functions of the engine's outputs; the handlers in worker/server/api/openai_routes.py send them.
Shapes follow the OpenAI API reference: legacy completions logprobs are
``{tokens, token_logprobs, top_logprobs, text_offset}``, chat logprobs are
``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from worker.engine.runner import TokenLogprob
from worker.engine.tokenizer import Tokenizer
from worker.server.api.tool_calls import ToolCall, ToolCallParser


@dataclass(slots=True)
class ResponseMeta:
    """What every body of one response repeats."""

    id: str
    model: str
    worker_id: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.worker_id}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], top_k: int,
                        text_offset: int) -> dict[str, Any]:
    """Legacy completions logprobs for consecutive tokens starting at ``text_offset``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in logprobs:
        text, _ = _token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for tid, value in lp.top[:top_k]:
            top.setdefault(_token_text(tokenizer, tid)[0], value)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps,
            "top_logprobs": tops if top_k > 0 else None, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], top_k: int) -> dict[str, Any]:
    """Chat logprobs (``content`` entries with bytes and top alternatives)."""
    content = []
    for lp in logprobs:
        text, raw = _token_text(tokenizer, lp.token_id)
        top = []
        for tid, value in lp.top[:top_k]:
            t, r = _token_text(tokenizer, tid)
            top.append({"token": t, "logprob": value, "bytes": list(r)})
        content.append({"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": top})
    return {"content": content, "refusal": None}


@dataclass(slots=True)
class ChoiceState:
    """Accumulated output of one choice."""

    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def tool_finish_reason(finish_reason: str | None, calls: list[ToolCall]) -> str | None:
    """``tool_calls`` for an answer that ended by itself with calls (a truncated one keeps ``length``)."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def chat_message(c: ChoiceState, parser: ToolCallParser | None) -> tuple[dict[str, Any], str | None]:
    """The assistant ``message`` of a whole chat answer and its finish reason; with ``parser``
    the text's tool calls become ``tool_calls`` (``content`` None when nothing else was said)."""
    if parser is None:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    parsed = parser.parse(c.text)
    if not parsed.tool_calls:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    message = {"role": "assistant", "content": parsed.content,
               "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
    return message, tool_finish_reason(c.finish_reason, parsed.tool_calls)


def full_response(meta: ResponseMeta, tokenizer: Tokenizer, choices: list[ChoiceState],
                  top_k: int | None, use: dict[str, Any], parser: ToolCallParser | None = None) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion (tool calls read with ``parser``)."""
    body = meta.head(chunk=False)
    out = []
    for c in choices:
        lp = None
        if top_k is not None:
            lp = (chat_logprobs(tokenizer, c.logprobs, top_k) if meta.chat
                  else completion_logprobs(tokenizer, c.logprobs, top_k, 0))
        if meta.chat:
            message, finish = chat_message(c, parser)
            out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            out.append({"index": c.index, "text": c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason})
    body["choices"] = out
    body["usage"] = use
    return body


def stream_chunk(meta: ResponseMeta, index: int, text: str, finish_reason: str | None,
                 logprobs: dict[str, Any] | None, include_usage: bool, first: bool = False) -> dict[str, Any]:
    """One SSE chunk carrying a choice's new text (and its logprobs / finish reason)."""
    body = meta.head(chunk=True)
    if meta.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if finish_reason is not None and not text and not first:
            delta = {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    body["choices"] = [choice]
    if include_usage:
        body["usage"] = None
    return body


def tool_calls_chunk(meta: ResponseMeta, index: int, calls: list[ToolCall], include_usage: bool) -> dict[str, Any]:
    """A chat stream chunk carrying a choice's tool calls, each whole (``index`` orders them)."""
    body = meta.head(chunk=True)
    body["choices"] = [{"index": index, "delta": {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]},
                        "logprobs": None, "finish_reason": None}]
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(meta: ResponseMeta, use: dict[str, Any]) -> dict[str, Any]:
    """The final chunk of a stream with ``include_usage``: no choices, the usage."""
    body = meta.head(chunk=True)
    body["choices"] = []
    body["usage"] = use
    return body
