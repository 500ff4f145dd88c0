"""Tool calls in a model's text, as vLLM's ``--tool-call-parser`` finds them: whole or streamed.

Two formats (vLLM's parser names):

- ``hermes`` (Hermes, Qwen 2.5): content, then one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
- ``llama3_json`` (Llama 3.x): the whole answer is ``{"name": ..., "parameters": {...}}``
  (several may follow one another, separated by ``;``); Llama's ``<|python_tag|>`` is a special
  token and never reaches the text.

Text that does not parse is content, never an error: the model answered, just not with a call.
Streaming (:class:`ToolCallStream`) sends content as it comes, holds back from the point where a
call may begin (a ``<tool_call>`` marker, or a ``{`` opening a Llama answer), and at the end
either sends the calls or releases what it held as content. Pure functions; the handlers in
worker/server/api/openai_routes.py turn the result into OpenAI's ``tool_calls``.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from protocol import untrusted_json


@dataclass(slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}`` (with ``index`` in a stream delta)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(slots=True)
class ParsedOutput:
    """What a model's text says: content (None when there is none) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # already JSON text: keep it if it is JSON
        try:
            untrusted_json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser(ABC):
    """A format: where a call may begin, and how a whole text parses."""

    name = ""

    @abstractmethod
    def call_start(self, text: str) -> int | None:
        """Index where a tool call begins in ``text`` (None: none has begun)."""

    @abstractmethod
    def undecided_tail(self, text: str) -> int:
        """Characters at the end of ``text`` that may still turn out to begin a call."""

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and tool calls of a whole answer."""


class HermesParser(ToolCallParser):
    """``<tool_call>{...}</tool_call>`` blocks after optional content."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def call_start(self, text: str) -> int | None:
        at = text.find(self.START)
        return None if at < 0 else at

    def undecided_tail(self, text: str) -> int:
        for n in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-n:]):
                return n
        return 0

    def parse(self, text: str) -> ParsedOutput:
        start = self.call_start(text)
        if start is None:
            return ParsedOutput(text, [])
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                call = _call_from(untrusted_json.loads(block), ("arguments",))
            except ValueError:
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(text[:start] or None, calls)


class Llama3JsonParser(ToolCallParser):
    """An answer that is JSON ``{"name", "parameters"}`` objects (``;``-separated)."""

    name = "llama3_json"
    _decoder = json.JSONDecoder()

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return 0 if stripped.startswith("{") else None

    def undecided_tail(self, text: str) -> int:
        return len(text) if not text.strip() else 0  # only leading whitespace: a call may follow

    def parse(self, text: str) -> ParsedOutput:
        if self.call_start(text) is None:
            return ParsedOutput(text, [])
        calls, pos = [], 0
        body = text.strip()
        while pos < len(body):
            try:
                obj, end = self._decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
                return ParsedOutput(text, [])
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedOutput(None, calls)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str) -> ToolCallParser:
    """The parser named ``name`` (one of :data:`PARSERS`)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()


class ToolCallStream:
    """One streamed choice: :meth:`add` returns the content safe to send now, :meth:`finish` the
    rest -- content that turned out not to be a call, or the calls."""

    __slots__ = ("parser", "_text", "_sent")

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self._text = ""
        self._sent = 0

    def add(self, piece: str) -> str:
        """Content to send for this new ``piece`` of text (held back where a call may begin)."""
        self._text += piece
        start = self.parser.call_start(self._text)
        safe = start if start is not None else len(self._text) - self.parser.undecided_tail(self._text)
        if safe <= self._sent:
            return ""
        out, self._sent = self._text[self._sent:safe], safe
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the answer: (content still to send, tool calls)."""
        parsed = self.parser.parse(self._text)
        rest = "" if parsed.tool_calls else self._text[self._sent:]
        self._sent = len(self._text)
        return rest, parsed.tool_calls
