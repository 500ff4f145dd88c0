"""A request's prompt as the token ids a vLLM backend computes for it.

No I/O (``router/fleet/tokenizers.py`` reads the files). Needs the ``engines`` extra
(``tokenizers``, ``jinja2``): the router imports this module only when ``--tokenizer`` is given.

To look a prompt up in a backend's block chain (router/routing/token_index.py) the router needs
the exact tokens the engine will see. For a completion that is the prompt tokenized with
special tokens (the tokenizer's post-processor adds BOS). For a chat, vLLM first rewrites the
OpenAI messages into its "conversation", then renders the checkpoint's chat template through
transformers (protocol/hf_chat_template.py) and tokenizes the text *without* special tokens.
The rewriting, for text messages, as vLLM 0.32 does it (``vllm/renderers/chat_utils.py``):

- the template's *content format* decides the shape of ``content``: ``"openai"`` when the
  template loops over a message's content (then a string becomes ``[{"type": "text", "text":
  s}]`` and text parts stay parts), ``"string"`` otherwise (text parts joined with ``"\\n"``);
  ``null`` content is an empty list / empty string;
- only ``role`` and ``content`` survive, plus ``tool_calls`` (assistant), ``tool_call_id``
  (tool), ``name``, and ``reasoning``/``reasoning_content`` (assistant); a tool message's list
  of text parts becomes one string;
- tool-call ``arguments`` that are JSON strings become objects (``{}`` when empty, invalid or
  not an object), and an empty ``tool_calls`` list is dropped;
- ``developer`` messages become ``system`` ones when the template never names "developer".

Images, audio and other non-text parts are out of scope: such a request is not looked up.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import jinja2.nodes

from protocol import untrusted_json
from protocol.hf_chat_template import render_chat_template, template_environment
from router.routing.precise import PromptTokens

log = logging.getLogger("prefixlb.router.tokens")

STRING_FORMAT = "string"
OPENAI_FORMAT = "openai"


class ChatTokensError(ValueError):
    """The request cannot be rendered the way the backend would (non-text parts, bad shapes)."""


def detect_content_format(template: str) -> str:
    """``"openai"`` when the template iterates over a message's ``content``, else ``"string"``.

    A simplification of vLLM's ``_detect_content_format``: any ``{% for x in <name>.content %}``
    or ``<name>['content']`` loop counts, whatever ``<name>`` is bound to.
    """
    try:
        ast = template_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return STRING_FORMAT
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return OPENAI_FORMAT
        if (isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const)
                and it.arg.value == "content"):
            return OPENAI_FORMAT
    return STRING_FORMAT


def _text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTokensError("message content must be a string, null or a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ChatTokensError("only text content parts can be looked up")
    return texts


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    if not isinstance(calls, list):
        return None
    if not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ChatTokensError("tool_calls entries must be objects with a function")
        call = {**call, "function": dict(call["function"])}
        args = call["function"].get("arguments")
        if isinstance(args, str) and args:
            try:
                args = untrusted_json.loads(args)
            except json.JSONDecodeError:
                args = {}
        call["function"]["arguments"] = args if isinstance(args, dict) else {}
        out.append(call)
    return out


def vllm_conversation(messages: list[Any], content_format: str, template: str = "") -> list[dict[str, Any]]:
    """The conversation vLLM hands the chat template for these OpenAI ``messages``."""
    if not isinstance(messages, list):
        raise ChatTokensError("messages must be a list")
    developer_ok = '"developer"' in template or "'developer'" in template
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTokensError("each message must be an object with a string role")
        role = message["role"]
        texts = _text_parts(message.get("content"))
        if role == "tool" or content_format == STRING_FORMAT:
            content: Any = "\n".join(texts)
        else:
            content = [{"type": "text", "text": t} for t in texts]
        result: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"))
            if calls is not None:
                result["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if isinstance(reasoning, str):
                result["reasoning"] = result["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        if role == "developer" and not developer_ok:
            result["role"] = "system"
        out.append(result)
    return out


@dataclass(slots=True)
class BackendTokenizer:
    """A checkpoint's chat template and ``tokenizer.json``: prompts -> the backend's token ids.

    Build it with :meth:`from_files` from the texts of ``tokenizer.json`` and
    ``tokenizer_config.json`` (the caller reads them; nothing here touches the disk).
    """

    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]
    content_format: str

    @classmethod
    def from_files(cls, tokenizer_json: str, tokenizer_config: dict[str, Any],
                   chat_template: str | None = None) -> "BackendTokenizer":
        """From ``tokenizer.json`` text and the parsed ``tokenizer_config.json``
        (``chat_template`` overrides the config's, e.g. from ``chat_template.jinja``)."""
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ChatTokensError(f"not a tokenizer.json: {exc}") from exc
        template = chat_template if chat_template is not None else tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = tokenizer_config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        template = template if isinstance(template, str) else None
        return cls(tokenizer=tok, chat_template=template, special_tokens=special,
                   content_format=detect_content_format(template) if template else STRING_FORMAT)

    def prompt_token_ids(self, prompt: str) -> list[int]:
        """A completions prompt's ids: tokenized with special tokens (BOS where the checkpoint adds it)."""
        return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)

    def render_chat(self, messages: list[Any], tools: list[Any] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The chat prompt text vLLM renders for these OpenAI ``messages``."""
        if self.chat_template is None:
            raise ChatTokensError("the checkpoint has no chat template")
        conversation = vllm_conversation(messages, self.content_format, self.chat_template)
        return render_chat_template(self.chat_template, conversation, tools, add_generation_prompt,
                                    special_tokens=self.special_tokens, **template_kwargs)

    def chat_token_ids(self, messages: list[Any], tools: list[Any] | None = None,
                       add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """The chat prompt's ids: the rendered text tokenized without adding special tokens."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


class BackendTokenizers:
    """The backend tokenizers the router has, by served model name: requests -> PromptTokens."""

    def __init__(self, tokenizers: dict[str, BackendTokenizer] | None = None) -> None:
        self._by_model = dict(tokenizers or {})

    def prompt_tokens(self, body: dict[str, Any], chat: bool) -> PromptTokens | None:
        """The request's prompt as its backend tokenizes it, or None when this router cannot say
        (no tokenizer for the model, a batch of prompts, a template that fails): the request is
        then routed on the byte-level estimate, as for any backend."""
        tok = self._by_model.get(body.get("model"))  # type: ignore[arg-type]
        if tok is None:
            return None
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list):
                    return None
                tools = body.get("tools")
                kwargs = body.get("chat_template_kwargs")
                kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
                kwargs.pop("add_generation_prompt", None)
                ids = tok.chat_token_ids(messages, tools if isinstance(tools, list) else None,
                                         add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                                         **kwargs)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    ids = tok.prompt_token_ids(prompt)
                elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in prompt):
                    ids = list(prompt)
                else:
                    return None
        except Exception as exc:  # noqa: BLE001 - a template may raise anything; routing goes on without
            log.debug("event=backend_tokenize_failed model=%s error=%r", body.get("model"), str(exc)[:200])
            return None
        return PromptTokens(tuple(ids), cache_salt=salt) if ids else None
