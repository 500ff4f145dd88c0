"""Chat templates: a simple documented default (the built-in models), or a checkpoint's Jinja template.

A Jinja template renders in transformers' environment (protocol/hf_chat_template.py), so the
worker produces the prompt vLLM or SGLang would produce from the same checkpoint.

The default renders, for each message in order (tools first when given)::

    <|tools|>\\n<tools as JSON><|end|>\\n
    <|{role}|>\\n{content}<|end|>\\n
    ...
    <|assistant|>\\n                      (when add_generation_prompt)

``content`` may be a string or a list of OpenAI content parts (text parts are concatenated,
other parts become their JSON); an assistant message's ``tool_calls`` follow its content as
JSON. In both, a tool call's ``arguments`` (a JSON string in OpenAI's messages) is an object,
as vLLM hands it to templates (:func:`with_tool_call_objects`). The format has no meaning to the tiny model; it only has to be deterministic and to make
a longer conversation's prompt start with the shorter one's.
"""
from __future__ import annotations

import json
from typing import Any

from protocol import untrusted_json
from worker.engine.errors import InvalidRequestError


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, sort_keys=True, ensure_ascii=False))
        return "".join(parts)
    raise InvalidRequestError("message content must be a string, null or a list of parts")


NO_TEMPLATE_MESSAGE = ("this model has no chat template: start the worker with --chat-template FILE "
                       "(a Jinja chat template), or send /v1/completions")
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def with_tool_call_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant tool call's ``arguments`` as an object, as vLLM hands them
    to a template (OpenAI sends a JSON string; templates write ``arguments | tojson``): a string
    that is not a JSON object becomes ``{}``. The caller's dicts are not changed."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list) and calls:
            fixed = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = untrusted_json.loads(fn["arguments"]) if fn["arguments"] else {}
                    except ValueError:
                        args = {}
                    call = {**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}
                fixed.append(call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def select_template(templates: dict[str, str], tools: list[Any] | None, name: str | None = None) -> str:
    """transformers' choice among named templates: ``name`` if given, else ``tool_use`` for a
    request with tools when there is one, else ``default``."""
    if name is None:
        name = "tool_use" if tools and "tool_use" in templates else "default"
    if name not in templates:
        raise InvalidRequestError(f"the model has no chat template named {name!r} "
                                  f"(it has: {', '.join(sorted(templates))})")
    return templates[name]


class ChatTemplate:
    """Renders chat messages to prompt text: the default format, or a checkpoint's Jinja template.

    ``jinja_source`` is one template, or named templates (``{"default": ..., "tool_use": ...}``,
    as ``tokenizer_config.json`` may list them); ``special_tokens`` are the tokenizer's special
    tokens by name (``bos_token``, ``eos_token``, ...), which templates read as variables.
    """

    def __init__(self, jinja_source: str | dict[str, str] | None = None, bos_token: str = "", eos_token: str = "",
                 special_tokens: dict[str, str] | None = None) -> None:
        self.templates: dict[str, str] | None = None
        if isinstance(jinja_source, str):
            self.templates = {"default": jinja_source}
        elif jinja_source is not None:
            self.templates = dict(jinja_source)
        self.jinja_source = self.templates.get("default") if self.templates else None
        self._special = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}
        if self.templates is not None:
            # Imported here: jinja2 comes with the worker extra, and the simulated worker runs without it.
            from protocol.hf_chat_template import ChatTemplateError, compile_chat_template

            for name, source in self.templates.items():
                try:
                    compile_chat_template(source)
                except ChatTemplateError as exc:
                    raise InvalidRequestError(f"chat template {name!r}: {exc}") from exc

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``); ``template_kwargs`` (a request's
        ``chat_template_kwargs``) become template variables, as in ``apply_chat_template``."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of objects")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if self.templates is not None:
            from protocol.hf_chat_template import ChatTemplateError, render_chat_template

            source = select_template(self.templates, tools)
            try:
                return render_chat_template(source, with_tool_call_objects(messages), tools or None,
                                            add_generation_prompt,
                                            special_tokens=self._special, **kwargs)
            except ChatTemplateError as exc:
                raise InvalidRequestError(f"chat template: {exc}") from exc
        if kwargs:
            raise InvalidRequestError("the built-in chat format takes no chat_template_kwargs "
                                      f"(got {', '.join(sorted(kwargs))})")
        messages = with_tool_call_objects(messages)
        out = []
        if tools:
            out.append(f"<|tools|>\n{json.dumps(tools, sort_keys=True, ensure_ascii=False)}<|end|>\n")
        for m in messages:
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise InvalidRequestError("each message needs a string role")
            text = _content_text(m.get("content"))
            if m.get("tool_calls"):
                text += json.dumps(m["tool_calls"], sort_keys=True, ensure_ascii=False)
            out.append(f"<|{role}|>\n{text}<|end|>\n")
        if add_generation_prompt:
            out.append("<|assistant|>\n")
        return "".join(out)
