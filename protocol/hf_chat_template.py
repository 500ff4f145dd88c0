"""Chat templates rendered exactly as transformers' ``apply_chat_template`` renders them.

A checkpoint's chat template (``tokenizer_config.json`` ``chat_template``, or
``chat_template.jinja``) is Jinja source. vLLM and SGLang render it through transformers, and
prefixlb's router must produce the very same text to know which token blocks a backend will
look up, so this module builds the same environment transformers does
(``transformers.utils.chat_template_utils._compile_jinja_template``, 5.x):

- ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and a ``{% generation %}`` block
  tag that renders its body unchanged (transformers uses it only to mark assistant tokens);
- filter ``tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)``:
  ``json.dumps`` with those defaults, *not* Jinja's HTML-escaping one;
- globals ``raise_exception(message)`` (raises :class:`ChatTemplateError`) and
  ``strftime_now(format)`` (the local time now);
- the render variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
  tokenizer's special tokens by name (``bos_token``, ``eos_token``, ...) and any extra
  template kwargs, which override the special tokens.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be compiled, or it refused the messages (``raise_exception``)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def template_environment() -> ImmutableSandboxedEnvironment:
    """A fresh Jinja environment configured as transformers' chat-template environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled in :func:`template_environment` (cached by source text)."""
    try:
        return template_environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat_template(source: str, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                         add_generation_prompt: bool = True, special_tokens: dict[str, str] | None = None,
                         documents: list[Any] | None = None, **template_kwargs: Any) -> str:
    """The prompt text ``apply_chat_template(messages, tools, tokenize=False, ...)`` returns."""
    variables = {**(special_tokens or {}), **template_kwargs}
    try:
        return compile_chat_template(source).render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
