"""Chat templates: a simple documented default, or a checkpoint's Jinja template.

A Jinja template renders in transformers' environment (protocol/hf_chat_template.py), so the
worker produces the prompt vLLM or SGLang would produce from the same checkpoint.

The default renders, for each message in order (tools first when given)::

    <|tools|>\\n<tools as JSON><|end|>\\n
    <|{role}|>\\n{content}<|end|>\\n
    ...
    <|assistant|>\\n                      (when add_generation_prompt)

``content`` may be a string or a list of OpenAI content parts (text parts are concatenated,
other parts become their JSON); an assistant message's ``tool_calls`` follow its content as
JSON. The format has no meaning to the tiny model; it only has to be deterministic and to make
a longer conversation's prompt start with the shorter one's.
"""
from __future__ import annotations

import json
from typing import Any

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


class ChatTemplate:
    """Renders chat messages to prompt text: the default format, or a Jinja template."""

    def __init__(self, jinja_source: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        self.jinja_source = jinja_source
        self._special = {"bos_token": bos_token, "eos_token": eos_token}
        if jinja_source is not None:
            # Imported here: jinja2 comes with the worker extra, and the simulated worker runs without it.
            from protocol.hf_chat_template import ChatTemplateError, compile_chat_template

            try:
                compile_chat_template(jinja_source)
            except ChatTemplateError as exc:
                raise InvalidRequestError(str(exc)) from exc

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (and ``tools``)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of objects")
        if self.jinja_source is not None:
            from protocol.hf_chat_template import ChatTemplateError, render_chat_template

            try:
                return render_chat_template(self.jinja_source, messages, tools or None,
                                            add_generation_prompt, special_tokens=self._special)
            except ChatTemplateError as exc:
                raise InvalidRequestError(f"chat template: {exc}") from exc
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
