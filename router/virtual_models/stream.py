"""An accepted (buffered) answer as the SSE events a streaming client expects.

A cascade cannot stream a stage while it runs: the answer must be judged whole first. So a
streaming client's time to first token is the small model's *whole* answer plus the judge
(plus, on escalation, the large model's whole answer); then the accepted answer arrives at
once, in the OpenAI chunk shapes: for chat a role chunk, one content chunk (with logprobs when
asked), a finish chunk; for completions one text chunk with its finish reason; then the usage
chunk when ``stream_options.include_usage`` is set, then ``[DONE]``.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

DONE = b"data: [DONE]\n\n"


def _event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_events(body: Mapping[str, Any], chat: bool, include_usage: bool) -> list[bytes]:
    """The SSE events of a whole response ``body`` (OpenAI shape), ending with ``[DONE]``."""
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint") if k in body}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list, **extra: Any) -> bytes:
        payload = {**head, "choices": choices, **extra}
        if include_usage and "usage" not in extra:
            payload["usage"] = None
        return _event(payload)

    events: list[bytes] = []
    for choice in body.get("choices") or []:
        index = choice.get("index", 0)
        if chat:
            message = choice.get("message") or {}
            events.append(chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]))
            delta: dict[str, Any] = {"content": message.get("content") or ""}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
            events.append(chunk([{"index": index, "delta": delta, "logprobs": choice.get("logprobs"),
                                  "finish_reason": None}]))
            events.append(chunk([{"index": index, "delta": {}, "logprobs": None,
                                  "finish_reason": choice.get("finish_reason")}]))
        else:
            events.append(chunk([{"index": index, "text": choice.get("text") or "", "logprobs": choice.get("logprobs"),
                                  "finish_reason": choice.get("finish_reason")}]))
    if include_usage:
        events.append(chunk([], usage=body.get("usage")))
    events.append(DONE)
    return events
