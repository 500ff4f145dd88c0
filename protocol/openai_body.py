"""Decoding a request body within limits: size (413), UTF-8, JSON, nesting depth, node count,
surrogates.

A hostile body must cost little to refuse. A JSON parser allocates an object per value and a
walk over the result visits each one, so ``[[],[],...]`` costs ~50x its size in memory and
~0.4 s of CPU per MiB; the structure of the body is therefore measured on its bytes (C string
operations, no objects per value) as they arrive (:class:`StructureCheck`, fed by
:func:`read_limited_body`) and the body refused before it is parsed -- before the rest of it is
even read, once the bytes received prove it over a limit:

* the number of values and keys ("nodes") is bounded by :meth:`RequestLimits.node_budget`,
  which grows with the body (real requests spend ≥ 4 bytes a node) up to a cap that still fits
  ``max_prompt_token_ids`` token ids;
* the nesting depth is bounded by ``max_depth``.

Fields a server does not read may hold containers (clients send ``metadata``, ``modalities``,
vLLM's extras), but only small and shallow ones (:func:`check_ignored_fields`). Bodies over
:data:`OFF_LOOP_BYTES` are decoded in a thread (:func:`decode_off_loop`) so the event loop keeps
serving while a legitimate 16 MiB prompt is parsed.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import weakref
from dataclasses import dataclass
from typing import AbstractSet, Any, AsyncIterator, Callable, Protocol, TypeVar

from protocol.openai_errors import OpenAIError, bad_request, body_too_large
from protocol.untrusted_json import scan_whole

T = TypeVar("T")

OFF_LOOP_BYTES = 1024 * 1024
_NOT_TOKENS = bytes(b for b in range(256) if b not in b'"[]{},:')
_OBJECTS_AS_LISTS = bytes.maketrans(b"{}", b"[]")
# A \uD800-\uDFFF escape; only these can decode to a lone surrogate (raw UTF-8 cannot carry one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyStream(Protocol):
    """What a request body is read from (aiohttp's ``StreamReader``; its ``is_eof`` and
    ``read_nowait``, when it has them, let a body that arrived whole be taken at once)."""

    def iter_chunked(self, n: int) -> AsyncIterator[bytes]: ...


# Per event loop: the bytes of request bodies being received right now (BodyBytes).
_RECEIVING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
RECEIVING_BYTES_FLOOR = 256 * 1024 * 1024
_LAST_RECEIVING: list = [None]  # (weak reference to the loop, its BodyBytes) last looked up


class BodyBytes:
    """Admission control for request bodies as they arrive: the bytes of all bodies being
    received by one process (one event loop) are capped at ``max(256 MiB, 4 x max_body_bytes)``;
    a body that would take the total over the cap is refused with a 503 (``Retry-After``) rather
    than buffered."""

    __slots__ = ("held", "cap")

    def __init__(self, cap: int) -> None:
        self.held = 0
        self.cap = cap

    @staticmethod
    def for_loop(limit: int, loop: asyncio.AbstractEventLoop | None = None) -> "BodyBytes":
        """The books of ``loop`` (the running loop when None; a caller that holds it saves
        ``get_running_loop``'s getpid() system call, CPython 3.11's check against a fork)."""
        if loop is None:
            loop = asyncio.get_running_loop()
        last = _LAST_RECEIVING[0]
        if last is not None and last[0]() is loop:  # the usual case: one loop (no weak-dict lookup)
            return last[1]
        books = _RECEIVING.get(loop)
        if books is None:
            books = _RECEIVING[loop] = BodyBytes(max(RECEIVING_BYTES_FLOOR, 4 * limit))
        _LAST_RECEIVING[0] = (weakref.ref(loop), books)
        return books


def _server_busy(cap: int) -> OpenAIError:
    return OpenAIError(503, f"Too many request body bytes are being received at once (over {cap}); retry",
                       "server_error", None, "server_busy")


BUFFER_FROM = 4 * 1024 * 1024


class Body(bytearray):
    """A request body as read by :func:`read_limited_body`: one buffer, filled as the body
    arrives; ``structure_checked`` when its node count and nesting were checked on the way in."""

    structure_checked = False


async def read_limited_body(content_length: int | None, content: BodyStream, limit: int,
                            timeout: float, limits: "RequestLimits | None" = None) -> Body:
    """The raw body: a 413 as soon as it is (or is declared) over ``limit`` bytes, a 408 when it
    has not all arrived within ``timeout`` seconds (slow clients cannot hold a handler), a 503
    when the bodies being received together would go over :class:`BodyBytes`' cap.

    With ``limits``, the JSON structure is checked as the body arrives (:class:`StructureCheck`):
    a body over its node budget or nesting limit is refused with a 400 as soon as the bytes
    received so far prove it, without reading (or holding) the rest. The body is collected in
    one buffer (no list of chunks joined into a second copy)."""
    whole = body_nowait(content_length, content, limit, limits)
    if whole is not None:
        return whole
    books = BodyBytes.for_loop(limit)
    check = StructureCheck(limits, content_length) if limits is not None else None
    buf = Body()
    # The first BUFFER_FROM bytes are kept as the chunks they arrived in (no copy: a hostile body
    # is refused within them holding nothing else); a body that goes on is moved into ``buf``.
    chunks: list[bytes] = []
    held = 0

    async def _read() -> None:
        nonlocal held
        async for chunk in content.iter_chunked(64 * 1024):
            if held + len(chunk) > limit:
                raise body_too_large(limit)
            if books.held + len(chunk) > books.cap:
                raise _server_busy(books.cap)
            books.held += len(chunk)
            held += len(chunk)
            if check is not None:
                check.feed(chunk)
            if held > BUFFER_FROM:
                if chunks:
                    for piece in chunks:
                        buf.extend(piece)
                    chunks.clear()
                buf.extend(chunk)
            else:
                chunks.append(chunk)
        for piece in chunks:
            buf.extend(piece)
        chunks.clear()
        if check is not None:
            check.finish()
            buf.structure_checked = True

    try:
        async with asyncio.timeout(timeout):  # not wait_for: no task of its own for every request
            await _read()
    except TimeoutError:
        raise OpenAIError(408, f"Request body not received within {timeout:g} s", code="timeout") from None
    finally:
        books.held -= held
    return buf


def body_nowait(content_length: int | None, content: BodyStream, limit: int,
                limits: "RequestLimits | None" = None, loop: asyncio.AbstractEventLoop | None = None) -> Body | None:
    """:func:`read_limited_body` without waiting: the body, checked as it would check it, when
    all of it has arrived already (a small body comes with the headers); None when some is still
    to come (nothing read then). A body declared over ``limit`` is a 413 either way. (``loop``:
    the running loop, where the caller holds it: see :meth:`BodyBytes.for_loop`.)"""
    if content_length is not None and content_length > limit:
        raise body_too_large(limit)
    is_eof = getattr(content, "is_eof", None)
    if is_eof is None or not is_eof():
        return None
    # the same checks, without a deadline, an iterator and a closure for every request
    return _whole_body(content.read_nowait(-1), limit, BodyBytes.for_loop(limit, loop), limits,  # type: ignore[attr-defined]
                       content_length)


def _whole_body(data: bytes, limit: int, books: BodyBytes, limits: "RequestLimits | None",
                declared_size: int | None) -> Body:
    """:func:`read_limited_body` of a body received whole: over ``limit`` a 413, over the bytes
    being received together a 503, over the structure limits a 400 (before it is copied). The
    exact :class:`StructureCheck` runs only for a body its byte counts do not clear."""
    if len(data) > limit:
        raise body_too_large(limit)
    if books.held + len(data) > books.cap:
        raise _server_busy(books.cap)
    if limits is not None:
        # StructureCheck's max_budget, then the budget of the actual size
        budget = min(limits.node_budget(limits.max_body_bytes if declared_size is None else declared_size),
                     limits.node_budget(len(data)))
        if not within_by_counts(data, limits.max_depth, budget):
            check = StructureCheck(limits, declared_size)
            check.feed(data)
            check.finish()
    buf = Body(data)
    buf.structure_checked = limits is not None
    return buf


def within_by_counts(data: bytes | bytearray, max_depth: int, budget: int) -> bool:
    """True when ``data`` provably holds at most ``budget`` JSON values and keys and nests at
    most ``max_depth`` deep, from four byte counts (strings included, so an overestimate of
    what :class:`StructureCheck` counts: it finds a body within these bounds within its limits
    too, valid JSON or not). Most requests are: their exact check is then skipped."""
    opens = data.count(b"[") + data.count(b"{")
    return opens <= max_depth and 1 + opens + data.count(b":") + data.count(b",") <= budget


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what one request may contain (defaults fit 1M-token prompts, nothing absurd)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_depth: int = 32
    max_prompt_chars: int = 8 * 1024 * 1024
    max_name_chars: int = 256
    max_messages: int = 4096
    max_content_parts: int = 512
    max_prompt_token_ids: int = 1_048_576
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 256
    max_tokens: int = 1_048_576
    max_n: int = 8
    max_logprobs: int = 20
    max_tools: int = 256
    max_json_nodes: int = 1_048_576 + 65_536  # a max_prompt_token_ids prompt and the rest of a request
    bytes_per_json_node: int = 4  # below the cap, 4,096 values and keys plus one per this many bytes
    max_ignored_nodes: int = 16_384  # in all the fields the server does not read (check_ignored_fields)
    max_ignored_depth: int = 16

    def node_budget(self, body_bytes: int) -> int:
        """How many JSON values and keys a body of ``body_bytes`` may hold."""
        return min(self.max_json_nodes, 4096 + body_bytes // self.bytes_per_json_node)


DEFAULT_LIMITS = RequestLimits()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# One decoder for every body: json.loads(text, parse_constant=...) builds a decoder and its
# scanner on each call, half the cost of decoding a small request. (_loads keeps json.loads'
# refusal of a leading BOM.)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _loads(text: str) -> Any:
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return scan_whole(_DECODER, text)


def parse_json_body(raw: bytes | bytearray, limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise a 4xx :class:`OpenAIError`.

    413 over ``max_body_bytes``; 400 for invalid UTF-8, more nodes than the body's
    :meth:`~RequestLimits.node_budget`, nesting deeper than ``max_depth``, malformed JSON,
    ``NaN``/``Infinity``, lone surrogates, or a top level that is not an object.
    """
    if len(raw) > limits.max_body_bytes:
        raise body_too_large(limits.max_body_bytes)
    if not raw or raw.isspace():
        raise bad_request("Request body is empty; expected a JSON object")
    if not getattr(raw, "structure_checked", False):
        _check_structure(raw, limits)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"Request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = _loads(text)
    except RecursionError:
        raise bad_request(f"JSON nesting is deeper than {limits.max_depth} levels") from None
    except ValueError as exc:  # json.JSONDecodeError and rejected constants
        raise bad_request(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        _check_strings(body)
    return body


# per event loop: at most one large body per core being checked and parsed (decode_off_loop)
_LARGE_PARSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def decode_off_loop(raw: bytes, decode: Callable[..., T], *args: Any) -> T:
    """``decode(raw, *args)``, in a worker thread when ``raw`` is over :data:`OFF_LOOP_BYTES`
    (parsing a large body would otherwise stall every other request and probe on the loop).

    At most one large body per core is being checked and parsed at a time: each holds several
    transient copies of its bytes, and more threads than cores only add memory, not speed."""
    if len(raw) <= OFF_LOOP_BYTES:
        return decode(raw, *args)
    loop = asyncio.get_running_loop()
    gate = _LARGE_PARSES.get(loop)
    if gate is None:
        gate = _LARGE_PARSES[loop] = asyncio.Semaphore(max(1, min(4, os.cpu_count() or 1)))
    async with gate:
        return await asyncio.to_thread(decode, raw, *args)


def _too_many_nodes(nodes: int, budget: int, size: int) -> OpenAIError:
    return bad_request(f"Request body holds {nodes} JSON values and keys; a body of {size} bytes may hold "
                       f"at most {budget}", code="too_many_json_values")


# Structure bytes as they are: '"', '[', ']', ',', ':'; '{' and '}' read as '[' and ']'; every
# other byte but whitespace becomes 'v' (part of a scalar: what makes '[1]' not an empty array).
_STRUCTURE = bytes(c if c in b'"[],:' else b"["[0] if c == b"{"[0] else b"]"[0] if c == b"}"[0] else b"v"[0]
                   for c in range(256))
_WHITESPACE = b" \t\r\n"
_QUOTE_AS_SCALAR = bytes.maketrans(b'"', b"v")


class StructureCheck:
    """The node count and nesting depth of a JSON body, exact for valid JSON, computed chunk by
    chunk as the body arrives (C string operations per chunk, nothing kept between chunks but a
    few counters): :meth:`feed` raises the 400 as soon as the bytes so far hold more values and
    keys than any body of the declared (or largest allowed) size may, or nest deeper than
    ``max_depth``; :meth:`finish` applies the budget of the body's actual size.

    Per chunk: escaped backslashes and quotes are removed (an odd run of backslashes at the end
    of a chunk waits for the next one); what lies between quotes outside strings is the
    structure, a string read as one scalar. Every value but the root follows a ``[``, ``:`` or
    ``,`` and every key a ``{`` or ``,``, except in an empty container, so the nodes are
    ``1 + #[ + #: + #, - #[]``. For the depth, the chunk's brackets are wrapped in the
    containers open before it and closed after it: a balanced sequence whose height (the passes
    of removing every ``[]`` it takes to empty it) is the deepest nesting reached in the chunk.
    Invalid JSON is left to the parser, whatever is counted here.
    """

    __slots__ = ("limits", "max_budget", "nodes", "depth", "size", "in_string", "carry", "last")

    def __init__(self, limits: RequestLimits, declared_size: int | None = None) -> None:
        self.limits = limits
        self.max_budget = limits.node_budget(limits.max_body_bytes if declared_size is None else declared_size)
        self.nodes = 1
        self.depth = 0
        self.size = 0
        self.in_string = False
        self.carry = b""  # a backslash escaping the first byte of the next chunk
        self.last = b""  # the last structure byte before this chunk ('v' after a string)

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Count one more piece of the body; a 400 once it is over budget or too deep."""
        self.size += len(chunk)
        data = self.carry + chunk if self.carry else bytes(chunk) if not isinstance(chunk, bytes) else chunk
        self.carry = b""
        if b"\\" in data:
            if (len(data) - len(data.rstrip(b"\\"))) & 1:
                data, self.carry = data[:-1], b"\\"
            data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        if b'"' not in data:  # no string starts or ends here: all string, or no string at all
            if self.in_string:
                return
            structure, prefix = data.translate(_STRUCTURE, _WHITESPACE), self.last
        else:
            tokens = data.translate(_STRUCTURE, _WHITESPACE)
            structure, prefix = self._plain_strings(tokens)
            if structure is None:  # some string here holds structure bytes: cut the strings out
                parts = tokens.split(b'"')
                if self.in_string:
                    prefix, pieces = b"v", parts[1::2]
                else:
                    prefix, pieces = self.last, parts[0::2]
                if len(parts) % 2 == 0:
                    self.in_string = not self.in_string
                structure = b"v".join(pieces)
                del parts, pieces
            del tokens
        if not self.in_string:
            self.last = (prefix + structure[-1:])[-1:]
        if b"[" not in structure:  # no container opens here (e.g. a run of strings or numbers)
            self.nodes += len(structure.translate(None, b"]v"))
            brackets = structure.translate(None, b",:v")
            opens = pairs = 0
        elif b"v" in structure:
            self.nodes += len(structure.translate(None, b"]v")) - structure.count(b"[]")
            brackets = structure.translate(None, b",:v")
            opens, pairs = brackets.count(b"["), brackets.count(b"[]")
        else:  # no scalar: in valid JSON a ',' or ':' is then always followed by a '[' (cheaper counts)
            brackets = structure.translate(None, b",:")
            opens, pairs = brackets.count(b"["), brackets.count(b"[]")
            self.nodes += len(structure) - len(brackets) + opens - pairs
        self.nodes -= prefix == b"[" and structure[:1] == b"]"
        del structure
        if self.nodes > self.max_budget:
            raise self._over(self.max_budget)
        if brackets:
            self._nest(brackets, opens, pairs)

    def _plain_strings(self, tokens: bytes) -> tuple[bytes | None, bytes]:
        """The chunk's structure and the byte before it when none of its strings holds a
        structure byte (then each string simply reads as scalar bytes: cheaper than cutting
        strings out one by one), else (None, b"") and nothing changed."""
        if self.in_string:  # the string open at the chunk's start ends at its first quote
            tokens = tokens[tokens.index(b'"') + 1:]
            prefix = b"v"
        else:
            prefix = self.last
        quotes = tokens.count(b'"')
        open_at_end = quotes % 2 == 1
        if open_at_end:
            tokens = tokens[:tokens.rindex(b'"')]
        bare = tokens.translate(None, b"v")  # strings free of structure bytes are '""' here
        if 2 * bare.count(b'""') != quotes - open_at_end:
            return None, b""
        self.in_string = open_at_end
        return tokens.translate(_QUOTE_AS_SCALAR), prefix

    def _nest(self, brackets: bytes, opens: int, pairs: int) -> None:
        """Follow the nesting through one chunk's brackets (``opens`` of them '[', ``pairs`` of
        them '[]')."""
        limit = self.limits.max_depth
        end = self.depth + opens - (len(brackets) - opens)
        if end < 0:
            raise bad_request("Request body is not valid JSON: more closing brackets than opening ones")
        if end > limit:
            raise bad_request(f"JSON nesting is deeper than {limit} levels")
        # Within the limit for sure: too few opening brackets, or no two in a row (then every
        # step up is followed by one down, and the walk never rises more than one level).
        no_two_opens_in_a_row = pairs == opens - brackets.endswith(b"[")
        if self.depth + 1 <= limit and (no_two_opens_in_a_row or self.depth + opens <= limit):
            self.depth = end
            return
        walk = b"[" * self.depth + brackets + b"]" * end
        for _ in range(limit):
            walk = walk.replace(b"[]", b"")
            if not walk:
                break
        else:
            if walk:
                raise bad_request(f"JSON nesting is deeper than {limit} levels")
        self.depth = end

    def _over(self, budget: int) -> OpenAIError:
        if self.depth >= self.limits.max_depth:
            return bad_request(f"JSON nesting is deeper than {self.limits.max_depth} levels")
        return _too_many_nodes(self.nodes, budget, self.size)

    def finish(self) -> None:
        """The budget of the body's actual size (the declared one may have been larger)."""
        budget = self.limits.node_budget(self.size)
        if self.nodes > budget:
            raise self._over(budget)


def _check_structure(raw: bytes, limits: RequestLimits) -> None:
    """Bound the node count and the depth of ``raw`` before it is parsed.

    Exact for valid JSON (invalid JSON is left to the parser, whatever is counted here): with
    escaped backslashes and quotes removed, every ``"`` delimits a string, and what lies between
    strings is the structure. Every value but the root follows a ``[``, ``:`` or ``,``, every key
    a ``{`` or ``,``, except right after the ``[`` or ``{`` of an empty container.
    """
    size = len(raw)
    budget = limits.node_budget(size)
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    tokens = raw.translate(_OBJECTS_AS_LISTS, _NOT_TOKENS)  # only '"[],:' are left; '{' is '['
    strings = tokens.count(b'"') // 2
    if strings > budget:  # each string is a value or a key; this also bounds the split below
        raise _too_many_nodes(strings, budget, size)
    structure = b"".join(tokens.split(b'"')[0::2])  # '{"a": [], "b": 1}' -> '[:[],:]'
    del tokens
    nodes = 1 + len(structure) - structure.count(b"]") - structure.count(b"[]")
    if nodes > budget:
        if b"[" * (limits.max_depth + 1) in structure:  # the usual deep body, named as such
            raise bad_request(f"JSON nesting is deeper than {limits.max_depth} levels")
        raise _too_many_nodes(nodes, budget, size)
    skeleton = structure.translate(None, b",:")
    # Each pass removes the innermost containers ("[]" is an empty one), so what is left after
    # max_depth passes nests deeper -- unless nothing can be removed: malformed, the parser says.
    for _ in range(limits.max_depth):
        if not skeleton:
            return
        skeleton = skeleton.replace(b"[]", b"")
    if b"[]" in skeleton:
        raise bad_request(f"JSON nesting is deeper than {limits.max_depth} levels")


def _check_strings(root: Any) -> None:
    """Refuse strings that cannot be encoded (lone surrogates), keys included."""
    stack: list[Any] = [root]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("Request contains an invalid unicode string (lone surrogate)") from None
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def check_ignored_fields(body: dict[str, Any], read: AbstractSet[str], limits: RequestLimits) -> None:
    """Refuse containers in the top-level fields outside ``read`` (the fields this server reads)
    that nest deeper than ``max_ignored_depth`` or hold more than ``max_ignored_nodes`` values
    and keys in all: they change nothing here, so all they can do is cost."""
    if read.issuperset(body):  # (the usual body: every field one this server reads)
        return
    left = limits.max_ignored_nodes
    for name, value in body.items():
        if name in read or not isinstance(value, (dict, list)):
            continue
        stack: list[tuple[Any, int]] = [(value, 1)]
        while stack:
            node, depth = stack.pop()
            left -= len(node) * (2 if isinstance(node, dict) else 1)
            if left < 0:
                raise bad_request(f"The fields this server does not read hold more than "
                                  f"{limits.max_ignored_nodes} JSON values and keys", name,
                                  "too_many_json_values")
            for child in (node.values() if isinstance(node, dict) else node):
                if isinstance(child, (dict, list)):
                    if depth >= limits.max_ignored_depth:
                        raise bad_request(f"'{name}' is not read by this server and nests deeper than "
                                          f"{limits.max_ignored_depth} levels", name, "nesting_too_deep")
                    stack.append((child, depth + 1))
