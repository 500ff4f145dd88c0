"""OpenAI request bodies: read them within limits, validate them, and say precisely what is wrong.

Router and worker both validate with this module (it is pure: no HTTP library), so a request
is judged the same way at the door and at the replica. Every problem raises
:class:`OpenAIError` carrying the HTTP status and OpenAI's error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

A hostile client cannot make validation expensive or crash it: the body size, JSON nesting
depth and node count, string sizes, list lengths and numbers are all bounded by
:class:`RequestLimits`, invalid UTF-8 and lone surrogates are refused, and booleans never pass
for numbers. Unknown fields are ignored (as vLLM does) as long as they are small and shallow,
but known fields whose behaviour we do not implement (penalties, ``logit_bias``, ``echo``, ...)
are refused when set to anything but their neutral value: a request is never silently served
differently from what it asked.

The error shape lives in protocol/openai_errors.py and body decoding in protocol/openai_body.py;
both are re-exported here, the one module callers import.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from protocol.openai_body import DEFAULT_LIMITS, RequestLimits, check_ignored_fields, parse_json_body
from protocol.openai_errors import (INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, SERVICE_UNAVAILABLE,
                                    OpenAIError, bad_request, body_too_large, error_body,
                                    model_not_found)

__all__ = [
    "DEFAULT_LIMITS", "INVALID_REQUEST", "NOT_FOUND", "SERVER_ERROR", "SERVICE_UNAVAILABLE",
    "ChatCompletionRequest", "CompletionRequest", "OpenAIError", "RequestLimits", "SamplingOptions",
    "bad_request", "body_too_large", "error_body", "model_not_found", "parse_chat_request",
    "parse_completion_request", "parse_json_body", "parse_request",
]

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

# The fields validated here; any other may only hold small, shallow containers (check_ignored_fields).
_COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "user", "session_id", "cache_salt", "lora_adapter", "n", "best_of",
    "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "logprobs",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias"})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "tools", "tool_choice", "response_format", "max_completion_tokens",
                                "top_logprobs", "chat_template_kwargs"}


# --------------------------------------------------------------------------- field readers

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float,
           lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", name)
    if value > hi or value < lo or (lo_open and value == lo):
        bound = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise bad_request(f"'{name}' must be {bound} and at most {hi}, got {value}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def _name(body: dict, name: str, limits: RequestLimits, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"'{name}' is required", name)
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name)
    if required and not value:
        raise bad_request(f"'{name}' must not be empty", name)
    if len(value) > limits.max_name_chars:
        raise bad_request(f"'{name}' is longer than {limits.max_name_chars} characters", name)
    return value


def _neutral(body: dict, name: str, neutral: Any, what: str) -> None:
    value = body.get(name)
    if value is None or value == neutral and type(value) is not bool:
        return
    raise bad_request(f"'{name}' is not supported by this server ({what})", name, "unsupported")


# --------------------------------------------------------------------------- sampling

@dataclass(slots=True)
class SamplingOptions:
    """The generation settings shared by completions and chat, validated.

    ``logprobs`` is ``None`` (no logprobs) or the number of top alternatives to return with
    each sampled token's own logprob. ``top_k`` 0 means disabled. ``max_tokens`` ``None`` means
    "up to the context length".
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1


def _stop(body: dict, limits: RequestLimits) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(items) > limits.max_stop:
        raise bad_request(f"'stop' may hold at most {limits.max_stop} sequences", "stop")
    for s in items:
        if not s:
            raise bad_request("'stop' sequences must not be empty", "stop")
        if len(s) > limits.max_stop_chars:
            raise bad_request(f"'stop' sequences are limited to {limits.max_stop_chars} characters", "stop")
    return list(items)


def _token_ids(body: dict, name: str, max_len: int) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise bad_request(f"'{name}' must be a list of integers", name)
    if len(value) > max_len:
        raise bad_request(f"'{name}' may hold at most {max_len} ids", name)
    if any(t < 0 or t > INT32_MAX for t in value):
        raise bad_request(f"'{name}' ids must be between 0 and {INT32_MAX}", name)
    return list(value)



# Fields most requests leave out: each group is read only when one of its fields is present (the
# same answers, without a helper call per absent field on every request).
_UNSUPPORTED_FIELDS = frozenset({"frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                                 "min_tokens", "logit_bias"})
_RARE_SAMPLING_FIELDS = frozenset({"n", "best_of", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"})
_OPTIONAL_NAMES = frozenset({"user", "session_id", "cache_salt", "lora_adapter"})


def _check_unsupported(body: dict) -> None:
    if _UNSUPPORTED_FIELDS.isdisjoint(body):
        return
    _neutral(body, "frequency_penalty", 0, "penalties are not implemented")
    _neutral(body, "presence_penalty", 0, "penalties are not implemented")
    _neutral(body, "repetition_penalty", 1, "penalties are not implemented")
    _neutral(body, "min_p", 0, "min_p sampling is not implemented")
    _neutral(body, "min_tokens", 0, "min_tokens is not implemented")
    value = body.get("logit_bias")
    if value is not None and not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object", "logit_bias")
    if value:
        raise bad_request("'logit_bias' is not supported by this server", "logit_bias", "unsupported")


def _temperature_top_p(body: dict) -> tuple[float, float]:
    return _float(body, "temperature", 1.0, 0.0, 2.0), _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)


def _sampling(body: dict, limits: RequestLimits, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
    _check_unsupported(body)
    if _RARE_SAMPLING_FIELDS.isdisjoint(body):
        temperature, top_p = _temperature_top_p(body)
        return SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=logprobs)
    n = _int(body, "n", 1, 1, limits.max_n)
    best_of = _int(body, "best_of", None, 1, limits.max_n)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' different from 'n' is not supported", "best_of", "unsupported")
    top_k = _int(body, "top_k", 0, -1, 1 << 20)
    temperature, top_p = _temperature_top_p(body)  # (after n, best_of and top_k: the errors' order)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
        seed=_int(body, "seed", None, INT64_MIN, INT64_MAX),
        stop=_stop(body, limits),
        stop_token_ids=_token_ids(body, "stop_token_ids", limits.max_stop_token_ids),
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=logprobs,
        n=n or 1,
    )


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, _bool(options, "include_usage")


# The fields every request has, as _common returns them (a tuple: read once, by the caller).
_Common = tuple[str, SamplingOptions, bool, bool, "str | None", "str | None", "str | None", "str | None"]


def _common(body: dict, limits: RequestLimits, max_tokens: int | None, logprobs: int | None) -> _Common:
    """model, sampling, stream, include_usage, user, session_id, cache_salt, lora_adapter."""
    model = _name(body, "model", limits, required=True)
    stream, include_usage = _stream(body)
    sampling = _sampling(body, limits, max_tokens, logprobs)
    if _OPTIONAL_NAMES.isdisjoint(body):
        return model or "", sampling, stream, include_usage, None, None, None, None
    return (model or "", sampling, stream, include_usage, _name(body, "user", limits),
            _name(body, "session_id", limits), _name(body, "cache_salt", limits),
            _name(body, "lora_adapter", limits))


# --------------------------------------------------------------------------- requests

@dataclass(slots=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body: one prompt, text or token ids."""

    model: str
    prompt: str | list[int]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    lora_adapter: str | None = None
    body: dict[str, Any] = field(default_factory=dict)
    chat = False


@dataclass(slots=True)
class ChatCompletionRequest:
    """A validated ``POST /v1/chat/completions`` body; ``messages`` keep their original dicts."""

    model: str
    messages: list[dict[str, Any]]
    sampling: SamplingOptions
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    lora_adapter: str | None = None
    body: dict[str, Any] = field(default_factory=dict)
    chat = True

    @property
    def tool_choice(self) -> str:
        """``none`` or ``auto``: as vLLM, ``auto`` when tools are given without a choice."""
        choice = self.body.get("tool_choice")
        return choice if isinstance(choice, str) else ("auto" if self.tools else "none")

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None:
        """Extra variables for the chat template (vLLM's ``chat_template_kwargs``)."""
        return self.body.get("chat_template_kwargs")


def _prompt(body: dict, limits: RequestLimits) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt is that prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("Batched prompts are not supported; send one request per prompt", "prompt",
                          "unsupported")
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise bad_request(f"'prompt' is longer than {limits.max_prompt_chars} characters", "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' must not be an empty list", "prompt")
        return _token_ids({"prompt": prompt}, "prompt", limits.max_prompt_token_ids)
    raise bad_request("'prompt' must be a string or a list of token ids", "prompt")


def parse_completion_request(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    """Validate a completions body (already decoded by :func:`parse_json_body`)."""
    check_ignored_fields(body, COMPLETION_FIELDS, limits)
    prompt = _prompt(body, limits)
    if _bool(body, "echo"):
        raise bad_request("'echo' is not supported by this server", "echo", "unsupported")
    if body.get("suffix") is not None:
        raise bad_request("'suffix' is not supported by this server", "suffix", "unsupported")
    max_tokens = _int(body, "max_tokens", 16, 1, limits.max_tokens)
    logprobs = _int(body, "logprobs", None, 0, limits.max_logprobs)
    model, sampling, stream, include_usage, user, session_id, cache_salt, lora_adapter = _common(
        body, limits, max_tokens, logprobs)
    return CompletionRequest(model, prompt, sampling, stream, include_usage, user, session_id, cache_salt,
                             lora_adapter, body)


def _content(content: Any, param: str, limits: RequestLimits) -> int:
    """Validate a message's content; return its size in characters."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        raise bad_request("'content' must be a string, null or a list of content parts", param)
    if len(content) > limits.max_content_parts:
        raise bad_request(f"'content' may hold at most {limits.max_content_parts} parts", param)
    size = 0
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type", "text"), str):
            raise bad_request("content parts must be objects with a string 'type'", p)
        if part.get("type", "text") == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request("a text content part needs a string 'text'", f"{p}.text")
            size += len(part["text"])
        else:
            size += len(json.dumps(part))
    return size


def _messages(body: dict, limits: RequestLimits) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list", "messages")
    if not messages:
        raise bad_request("'messages' must not be empty", "messages")
    if len(messages) > limits.max_messages:
        raise bad_request(f"'messages' may hold at most {limits.max_messages} messages", "messages")
    total = 0
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request("each message must be an object", param)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"'role' must be one of {', '.join(CHAT_ROLES)}", f"{param}.role")
        name = m.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > limits.max_name_chars):
            raise bad_request(f"'name' must be a string of at most {limits.max_name_chars} characters",
                              f"{param}.name")
        total += _content(m.get("content"), f"{param}.content", limits)
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise bad_request("'tool_calls' must be a list of objects", f"{param}.tool_calls")
            total += len(json.dumps(calls))
        if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise bad_request("'tool_call_id' must be a string", f"{param}.tool_call_id")
        if total > limits.max_prompt_chars:
            raise bad_request(f"'messages' hold more than {limits.max_prompt_chars} characters", "messages")
    return messages


def _tools(body: dict, limits: RequestLimits) -> list[dict[str, Any]] | None:
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad_request("'tool_choice' other than 'none' or 'auto' is not supported", "tool_choice",
                          "unsupported")
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    if len(tools) > limits.max_tools:
        raise bad_request(f"'tools' may hold at most {limits.max_tools} tools", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("each tool needs a 'function' object with a string 'name'",
                              f"tools[{i}].function")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad_request("'tool_choice' other than 'none' or 'auto' is not supported", "tool_choice",
                          "unsupported")
    return tools


def _response_format(body: dict) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("'response_format' must be an object with a string 'type'", "response_format")
    if fmt["type"] != "text":
        raise bad_request(f"'response_format' {fmt['type']!r} is not supported by this server",
                          "response_format", "unsupported")


def _chat_template_kwargs(body: dict, limits: RequestLimits) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if len(json.dumps(kwargs)) > limits.max_prompt_chars:
        raise bad_request(f"'chat_template_kwargs' hold more than {limits.max_prompt_chars} characters",
                          "chat_template_kwargs")


def parse_chat_request(body: dict[str, Any], limits: RequestLimits = DEFAULT_LIMITS) -> ChatCompletionRequest:
    """Validate a chat-completions body (already decoded by :func:`parse_json_body`).

    ``max_completion_tokens`` wins over the deprecated ``max_tokens``; ``top_logprobs``
    requires ``logprobs: true``.
    """
    check_ignored_fields(body, CHAT_FIELDS, limits)
    messages = _messages(body, limits)
    tools = _tools(body, limits)
    _response_format(body)
    _chat_template_kwargs(body, limits)
    max_tokens = _int(body, "max_completion_tokens", None, 1, limits.max_tokens)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1, limits.max_tokens)
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, limits.max_logprobs)
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    model, sampling, stream, include_usage, user, session_id, cache_salt, lora_adapter = _common(
        body, limits, max_tokens, (top or 0) if want_logprobs else None)
    return ChatCompletionRequest(model, messages, sampling, tools, stream, include_usage, user, session_id,
                                 cache_salt, lora_adapter, body)


def parse_request(raw: bytes, chat: bool, limits: RequestLimits = DEFAULT_LIMITS
                  ) -> CompletionRequest | ChatCompletionRequest:
    """Decode and validate a raw body for ``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    body = parse_json_body(raw, limits)
    return parse_chat_request(body, limits) if chat else parse_completion_request(body, limits)
