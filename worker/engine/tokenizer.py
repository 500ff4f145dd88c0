"""Tokenizers the engine and server use: byte-level for the built-in models, a checkpoint's ``tokenizer.json``.

Both expose the same surface: ``encode(text, add_bos=True)``, ``decode(ids)``,
``token_bytes(id)``, ``bos_token_id``, ``eos_token_id``, ``vocab_size``,
``apply_chat_template(messages, tools=None, add_generation_prompt=True, template_kwargs=None)``,
``encode_chat(...)`` (the token ids transformers' ``apply_chat_template(tokenize=True)`` gives)
and ``incremental_detokenizer()``, which turns a stream of token ids into text pieces that never
split a UTF-8 character (``tokenizers``' ``DecodeStream`` where it exists).

A checkpoint directory must bring its tokenizer (or be given one with ``--tokenizer DIR``):
prefixlb never serves a real model through a tokenizer it made up.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Protocol

from worker.engine.chat_template import NO_TEMPLATE_MESSAGE, ChatTemplate
from worker.engine.errors import InvalidRequestError, ModelLoadError

BYTE_VOCAB_SIZE = 258
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257


class IncrementalDetokenizer(Protocol):
    """Turns token ids, one at a time, into new text (complete characters only)."""

    def add(self, token_id: int) -> str:
        """Text newly completed by ``token_id`` (may be empty)."""
        ...

    def flush(self) -> str:
        """Whatever is still pending at the end of the stream (replacement chars if invalid)."""
        ...


class Tokenizer(Protocol):
    """What the engine and the server need from a tokenizer."""

    bos_token_id: int | None
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def incremental_detokenizer(self) -> IncrementalDetokenizer: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                            add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None) -> str: ...
    def encode_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None
                    ) -> list[int]: ...


class _ByteDetokenizer:
    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._decoder.decode(bytes((token_id,)))
        return ""

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """One UTF-8 byte = one token (ids 0-255), plus BOS (256) and EOS (257). Works on any text."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_token_id: int | None = BYTE_BOS_ID
    eos_token_id: int | None = BYTE_EOS_ID

    def __init__(self, chat_template: ChatTemplate | None = None) -> None:
        self.chat_template = chat_template or ChatTemplate()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text`` (UTF-8 bytes), after BOS when ``add_bos``."""
        ids = list(text.encode("utf-8", "surrogatepass"))
        return [BYTE_BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are skipped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (empty for special tokens)."""
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def incremental_detokenizer(self) -> IncrementalDetokenizer:
        return _ByteDetokenizer()

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                            add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat prompt text (without BOS: ``encode`` adds it)."""
        return self.chat_template.render(messages, tools, add_generation_prompt, template_kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None
                    ) -> list[int]:
        """BOS, then the chat prompt's bytes."""
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, template_kwargs))


class _HFDetokenizer:
    """vLLM's prefix/read-offset scheme: decode a short window, emit only completed text."""

    __slots__ = ("_tok", "_ids", "_prefix", "_read")

    def __init__(self, tok: "HFTokenizer") -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):]


class _DecodeStreamDetokenizer:
    """``tokenizers``' own incremental decoder (Rust, O(1) per token): it holds back a token
    that ends inside a UTF-8 character or a byte-fallback sequence until it completes."""

    __slots__ = ("_tok", "_stream", "_pending")

    def __init__(self, tok: "HFTokenizer", stream_cls: Any) -> None:
        self._tok = tok
        self._stream = stream_cls(skip_special_tokens=True)
        self._pending: list[int] = []

    def add(self, token_id: int) -> str:
        self._pending.append(token_id)
        text = self._stream.step(self._tok._tok, token_id)
        if text is None:
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        # What the stream still holds never became valid UTF-8: decoded alone, as replacement chars.
        text = self._tok.decode(self._pending) if self._pending else ""
        self._pending.clear()
        return text


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` (Hugging Face ``tokenizers``) and its chat template.

    ``chat_template`` (the text of ``--chat-template FILE``) replaces the checkpoint's; with
    neither, chat requests are refused (:data:`~worker.engine.chat_template.NO_TEMPLATE_MESSAGE`)
    while completions still work, as in vLLM.
    """

    def __init__(self, directory: str | Path, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as _Tok

        directory = Path(directory)
        try:
            self._tok = _Tok.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelLoadError(f"cannot read {directory / 'tokenizer.json'}: {exc}") from exc
        cfg = _read_json(directory / "tokenizer_config.json")
        model_cfg = _read_json(directory / "config.json")
        self.bos_token_id = self._special_id(cfg.get("bos_token"), model_cfg.get("bos_token_id"))
        eos = model_cfg.get("eos_token_id")
        self.eos_token_id = self._special_id(cfg.get("eos_token"), eos[0] if isinstance(eos, list) else eos)
        add_bos = cfg.get("add_bos_token")
        if not isinstance(add_bos, bool):  # as transformers: BOS when tokenizer.json's post-processor adds it
            first = self._tok.encode("", add_special_tokens=True).ids[:1]
            add_bos = self.bos_token_id is not None and first == [self.bos_token_id]
        self.add_bos = add_bos
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        template: Any = chat_template if chat_template is not None else _checkpoint_template(directory, cfg)
        # The template sees the special tokens tokenizer_config.json names (transformers'
        # special_tokens_map), not ids guessed from config.json.
        special = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if (text := _token_content(cfg.get(name))) is not None}
        self.chat_template: ChatTemplate | None = None
        if template is not None:
            try:
                self.chat_template = ChatTemplate(template, special_tokens=special)
            except InvalidRequestError as exc:
                raise ModelLoadError(f"{directory}: {exc}") from exc
        # A ByteLevel decoder spells each byte as one printable character: a token's raw bytes
        # are its characters mapped back (decoding one token alone would turn a byte that is
        # part of a longer UTF-8 character into U+FFFD).
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._added = {i: t for i, t in self._tok.get_added_tokens_decoder().items()}

    def _special_id(self, token: Any, fallback: Any) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            found = self._tok.token_to_id(token)
            if found is not None:
                return found
        return int(fallback) if isinstance(fallback, int) else None

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:  # added tokens are their text (special ones: nothing)
            return b"" if added.special else added.content.encode("utf-8")
        if self._byte_level:
            piece = self._tok.id_to_token(token_id) or ""
            return bytes(_UNICODE_TO_BYTE[ch] for ch in piece if ch in _UNICODE_TO_BYTE)
        return self._tok.decode([token_id], skip_special_tokens=True).encode("utf-8")

    def incremental_detokenizer(self) -> IncrementalDetokenizer:
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            return _HFDetokenizer(self)
        return _DecodeStreamDetokenizer(self, DecodeStream)

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None) -> str:
        if self.chat_template is None:
            raise InvalidRequestError(NO_TEMPLATE_MESSAGE)
        return self.chat_template.render(messages, tools, add_generation_prompt, template_kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                            add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text, less a leading BOS text (``encode`` adds BOS as a token)."""
        text = self._render(messages, tools, add_generation_prompt, template_kwargs)
        bos = self._token_text(self.bos_token_id)
        if bos and self.add_bos and self.bos_token_id is not None and text.startswith(bos):
            text = text[len(bos):]
        return text

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None
                    ) -> list[int]:
        """``apply_chat_template(..., tokenize=True)``: the rendered text encoded without added
        special tokens; whatever special tokens the template writes are matched in the text."""
        text = self._render(messages, tools, add_generation_prompt, template_kwargs)
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable character for each byte: how a ``ByteLevel`` tokenizer spells bytes."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_UNICODE_TO_BYTE = {ch: b for b, ch in byte_level_alphabet().items()}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _checkpoint_template(directory: Path, cfg: dict[str, Any]) -> str | dict[str, str] | None:
    """The checkpoint's chat template as transformers finds it: ``chat_template.jinja`` beside
    the tokenizer, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
    ``{"name", "template"}`` named templates)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            raise ModelLoadError(f"{directory / 'tokenizer_config.json'}: named chat templates need a string "
                                 "name and template each")
        return named or None
    return None


def read_chat_template_file(path: str | Path) -> str:
    """The text of ``--chat-template FILE``; ModelLoadError if unreadable."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the chat template {path}: {exc}") from exc


def load_tokenizer(directory: str | Path | None, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint (or ``--tokenizer``) ``directory``; the byte-level tokenizer
    of the built-in models when ``directory`` is None. ``chat_template`` (Jinja text) replaces
    the checkpoint's. A directory without ``tokenizer.json`` is refused (ModelLoadError)."""
    if directory is None:
        return ByteTokenizer(ChatTemplate(chat_template) if chat_template is not None else None)
    if not (Path(directory) / "tokenizer.json").is_file():
        raise ModelLoadError(f"{directory} has no tokenizer.json: give the checkpoint's tokenizer with "
                             "--tokenizer DIR (prefixlb serves a checkpoint only with its own tokenizer)")
    return HFTokenizer(directory, chat_template)
