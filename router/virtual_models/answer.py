"""One stage's buffered answer and the request/response edits a cascade makes around it.

A cascade sends the client's *original* request to each stage model, non-streaming (the answer
must be judged whole before any of it may reach the client), with logprobs switched on when
the stage's judge needs them; what it returns has them stripped again unless the client asked.
``Send`` is the one dependency: "send this body to model M, give me the full answer".
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from router.cost.pricing import Usage, usage_from_openai


class StageError(Exception):
    """A stage could not answer. ``retryable``: an upstream failure (5xx, timeout, no worker),
    worth escalating past; otherwise a client error (4xx) every stage would repeat."""

    def __init__(self, message: str, status: int = 502, retryable: bool = True,
                 body: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.body = dict(body) if body is not None else None


@dataclass(slots=True)
class StageAnswer:
    """A complete (non-streamed) OpenAI response of ``model`` and who served it."""

    model: str
    body: dict[str, Any]
    worker_id: str | None = None

    @property
    def usage(self) -> Usage:
        """The response's token counts (cached tokens included)."""
        return usage_from_openai(self.body.get("usage"))


Send = Callable[[str, dict[str, Any]], Awaitable[StageAnswer]]
"""``await send(model, body)``: the full answer of ``model`` to ``body`` (raises StageError)."""


def client_wants_logprobs(body: Mapping[str, Any], chat: bool) -> bool:
    """Whether the client asked for logprobs (chat: ``logprobs: true``; completions: an int)."""
    value = body.get("logprobs")
    if chat:
        return value is True
    return value is not None and value is not False


def stage_request(body: Mapping[str, Any], model: str, chat: bool, want_logprobs: bool) -> dict[str, Any]:
    """The original request for ``model``: not streamed, with logprobs when wanted."""
    out = copy.deepcopy(dict(body))
    out["model"] = model
    out["stream"] = False
    out.pop("stream_options", None)
    if want_logprobs and not client_wants_logprobs(body, chat):
        out["logprobs"] = True if chat else 0
    return out


def strip_logprobs(body: dict[str, Any]) -> None:
    """Remove the logprobs the router asked for, in place (``null`` as when not requested)."""
    for choice in body.get("choices") or []:
        if isinstance(choice, dict) and "logprobs" in choice:
            choice["logprobs"] = None


def _first_choice(body: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        return choices[0]
    return {}


def answer_text(body: Mapping[str, Any]) -> str:
    """The first choice's text (chat: the message content, tool calls appended as JSON)."""
    choice = _first_choice(body)
    if "text" in choice:
        return choice.get("text") or ""
    message = choice.get("message")
    if not isinstance(message, Mapping):
        return ""
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], sort_keys=True, ensure_ascii=False)
    return text


def token_logprobs(body: Mapping[str, Any]) -> tuple[float, ...] | None:
    """The first choice's per-token logprobs, or None when the answer carries none."""
    lp = _first_choice(body).get("logprobs")
    if not isinstance(lp, Mapping):
        return None
    if isinstance(lp.get("content"), list):  # chat
        values = [e.get("logprob") for e in lp["content"] if isinstance(e, Mapping)]
    elif isinstance(lp.get("token_logprobs"), list):  # completions
        values = lp["token_logprobs"]
    else:
        return None
    return tuple(float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, Mapping) and p.get("type", "text") == "text" and isinstance(p.get("text"), str))
    return ""


def question_text(body: Mapping[str, Any], chat: bool) -> str:
    """What the client asked: the completion prompt, or the last user message's text."""
    if not chat:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else ""
    for message in reversed(body.get("messages") or []):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return _text_of(message.get("content"))
    return ""


def all_text(body: Mapping[str, Any], chat: bool) -> str:
    """The text of every message (system and history included), for keyword and regex rules."""
    if not chat:
        return question_text(body, chat)
    parts = [_text_of(m.get("content")) for m in body.get("messages") or [] if isinstance(m, Mapping)]
    return "\n".join(parts)
