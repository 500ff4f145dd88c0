"""Tokenizers the engine and server use: byte-level by default, ``tokenizer.json`` when present.

Both expose the same surface: ``encode(text, add_bos=True)``, ``decode(ids)``,
``token_bytes(id)``, ``bos_token_id``, ``eos_token_id``, ``vocab_size``,
``apply_chat_template(messages, tools=None, add_generation_prompt=True)`` and
``incremental_detokenizer()``, which turns a stream of token ids into text pieces that never
split a UTF-8 character.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Protocol

from worker.engine.chat_template import ChatTemplate
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
                            add_generation_prompt: bool = True) -> str: ...


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
                            add_generation_prompt: bool = True) -> str:
        """The chat prompt text (without BOS: ``encode`` adds it)."""
        return self.chat_template.render(messages, tools, add_generation_prompt)


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


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` (Hugging Face ``tokenizers``) and its chat template."""

    def __init__(self, directory: str | Path) -> None:
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
        self.add_bos = bool(cfg.get("add_bos_token", self.bos_token_id is not None))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        template = cfg.get("chat_template")
        if not isinstance(template, str) and (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        try:
            self.chat_template = ChatTemplate(
                template if isinstance(template, str) else None,
                bos_token=self._token_text(self.bos_token_id),
                eos_token=self._token_text(self.eos_token_id))
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
        return _HFDetokenizer(self)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                            add_generation_prompt: bool = True) -> str:
        text = self.chat_template.render(messages, tools, add_generation_prompt)
        # Jinja templates usually start with the BOS text themselves; encode() adds it again.
        bos = self._token_text(self.bos_token_id)
        if bos and self.add_bos and text.startswith(bos):
            text = text[len(bos):]
        return text


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


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """``tokenizer.json`` from ``directory`` when present, else the byte-level tokenizer."""
    if directory is not None and (Path(directory) / "tokenizer.json").exists():
        return HFTokenizer(directory)
    return ByteTokenizer()
