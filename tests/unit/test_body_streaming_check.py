"""protocol.openai_body.StructureCheck: the node count and the nesting of a body, counted chunk by
chunk as it arrives, equal the true ones of the parsed JSON however the body is cut, brackets,
quotes and backslashes inside strings included; an over-budget body is refused before its end."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.openai_api import OpenAIError, RequestLimits, parse_json_body
from protocol.openai_body import StructureCheck, read_limited_body


def _true_nodes_and_depth(value, depth: int = 0) -> tuple[int, int]:
    """Values and keys, and the deepest container nesting, of a parsed JSON value."""
    if isinstance(value, dict):
        nodes, deepest = 1 + len(value), depth + 1
        for child in value.values():
            n, d = _true_nodes_and_depth(child, depth + 1)
            nodes, deepest = nodes + n, max(deepest, d)
        return nodes, deepest
    if isinstance(value, list):
        nodes, deepest = 1, depth + 1
        for child in value:
            n, d = _true_nodes_and_depth(child, depth + 1)
            nodes, deepest = nodes + n, max(deepest, d)
        return nodes, deepest
    return 1, depth


def _fed(raw: bytes, cuts: list[int], limits: RequestLimits = RequestLimits(max_depth=64)) -> StructureCheck:
    check = StructureCheck(limits, len(raw))
    start = 0
    for cut in sorted({min(c, len(raw)) for c in cuts}) + [len(raw)]:
        check.feed(raw[start:cut])
        start = cut
    check.finish()
    return check


# strings full of what a naive count would take for structure
_text = st.text(alphabet=list('ab[]{},:"\\ \n\u00e9\u4e2d\x00'), max_size=12)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | _text,
                     lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_text, inner, max_size=5),
                     max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(value=_json, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
       indent=st.sampled_from([None, 1]), ascii_only=st.booleans())
def test_the_streamed_count_is_exact_however_the_body_is_cut(value, cuts, indent, ascii_only):
    raw = json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode()
    check = _fed(raw, cuts)
    assert (check.nodes, check.depth) == (_true_nodes_and_depth(value)[0], 0)


@settings(max_examples=200, deadline=None)
@given(value=_json, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_nesting_one_level_past_the_limit_is_refused_and_at_the_limit_accepted(value, cuts):
    raw = json.dumps(value).encode()
    depth = _true_nodes_and_depth(value)[1]
    if depth:
        _fed(raw, cuts, RequestLimits(max_depth=depth))
        with pytest.raises(OpenAIError, match="nesting is deeper than"):
            _fed(raw, cuts, RequestLimits(max_depth=depth - 1))


def test_escapes_split_between_chunks_are_followed():
    value = {"a": 'x\\"]]]]][[[,,,:"\\', "b": [1, [2, "\\\\"]]}
    raw = json.dumps(value).encode()
    for cut in range(len(raw) + 1):
        assert _fed(raw, [cut]).nodes == _true_nodes_and_depth(value)[0]
        assert _fed(raw, list(range(0, len(raw), 1))).nodes == _true_nodes_and_depth(value)[0]


def test_16mib_of_brackets_inside_a_prompt_string_is_one_value():
    prompt = "[{,:}]" * (16 * 1024 * 1024 // 6 - 20)
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    check = _fed(raw, list(range(0, len(raw), 65536)), RequestLimits())
    assert check.nodes == 5


def _junk_body(size: int) -> bytes:
    return b'{"model":"m","prompt":"x","junk":[' + b"[]," * ((size - 64) // 3) + b"[]]}"


def test_an_over_budget_body_is_refused_once_a_fifth_of_it_has_arrived():
    raw = _junk_body(16 * 1024 * 1024)
    limits = RequestLimits()
    check = StructureCheck(limits, len(raw))
    with pytest.raises(OpenAIError) as info:
        for start in range(0, len(raw), 65536):
            check.feed(raw[start:start + 65536])
    assert (info.value.status, info.value.code) == (400, "too_many_json_values")
    assert check.size < len(raw) // 4  # ~1.1M nodes of 3 bytes: 3.3 MiB of 16


class _Stream:
    """A request body arriving in chunks, counting how much of it was read."""

    def __init__(self, raw: bytes, chunk: int = 65536) -> None:
        self.raw, self.chunk, self.read = raw, chunk, 0

    async def iter_chunked(self, n: int):
        for start in range(0, len(self.raw), self.chunk):
            piece = self.raw[start:start + self.chunk]
            self.read += len(piece)
            yield piece


def test_reading_stops_at_the_chunk_that_proves_the_body_over_budget():
    raw = _junk_body(16 * 1024 * 1024)
    stream = _Stream(raw)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_limited_body(len(raw), stream, 16 * 1024 * 1024, 30.0, RequestLimits()))
    assert info.value.status == 400
    assert stream.read < len(raw) // 4


def test_a_body_checked_as_it_arrived_parses_to_the_same_object_unchecked_twice(monkeypatch):
    value = {"model": "m", "messages": [{"role": "user", "content": "[{\\\"x\\\": 1}]" * 1000}]}
    raw = json.dumps(value).encode()
    body = asyncio.run(read_limited_body(len(raw), _Stream(raw, 777), 1 << 24, 30.0, RequestLimits()))
    assert body.structure_checked and bytes(body) == raw
    import protocol.openai_body as openai_body
    monkeypatch.setattr(openai_body, "_check_structure", lambda *a: pytest.fail("counted twice"))
    assert parse_json_body(body) == value


def test_the_budget_of_the_actual_size_applies_at_the_end():
    # declared large (so no early refusal) but the body is small: its own budget applies
    limits = RequestLimits(max_json_nodes=100_000, bytes_per_json_node=4)
    raw = b'{"a":[' + b"0," * 20000 + b"0]}"
    check = StructureCheck(limits, 1 << 24)
    check.feed(raw)
    with pytest.raises(OpenAIError, match="JSON values and keys"):
        check.finish()


def test_the_bytes_being_received_together_are_capped_with_a_503_and_given_back():
    from protocol.openai_body import BodyBytes

    class Paused:
        """60,000 bytes, then nothing until released, then the rest."""

        def __init__(self, release: asyncio.Event) -> None:
            self.release = release

        async def iter_chunked(self, n: int):
            yield b" " * 60_000
            await self.release.wait()
            yield b'{"a":1}'

    async def main() -> None:
        books = BodyBytes.for_loop(1 << 24)
        books.cap = 100_000
        release = asyncio.Event()
        first = asyncio.ensure_future(read_limited_body(None, Paused(release), 1 << 24, 5.0, RequestLimits()))
        await asyncio.sleep(0.01)
        assert books.held == 60_000
        with pytest.raises(OpenAIError) as info:  # a second body would take the total over the cap
            await read_limited_body(None, _Stream(b'{"b":"' + b"x" * 59_990 + b'"}'), 1 << 24, 5.0, RequestLimits())
        assert (info.value.status, info.value.code) == (503, "server_busy")
        assert books.held == 60_000  # the refused body gave its bytes back
        release.set()
        assert bytes(await first).strip() == b'{"a":1}'
        assert books.held == 0
        body = await read_limited_body(None, _Stream(b'{"b":"' + b"x" * 59_990 + b'"}'), 1 << 24, 5.0, RequestLimits())
        assert len(body) == 59_998 and books.held == 0

    asyncio.run(main())


class _Arrived:
    """A body that arrived whole before the handler reads it (aiohttp's StreamReader at EOF)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def is_eof(self) -> bool:
        return True

    def read_nowait(self, n: int = -1) -> bytes:
        data, self.raw = self.raw, b""
        return data

    async def iter_chunked(self, n: int):
        pytest.fail("a body that arrived whole is taken at once, not iterated")
        yield b""


def test_a_body_that_arrived_whole_gets_the_same_checks_at_once():
    value = {"model": "m", "prompt": "[1, 2]" * 100}
    raw = json.dumps(value).encode()
    body = asyncio.run(read_limited_body(len(raw), _Arrived(raw), 1 << 24, 30.0, RequestLimits()))
    assert body.structure_checked and bytes(body) == raw and parse_json_body(body) == value

    with pytest.raises(OpenAIError) as too_large:  # chunked: no length declared, over the limit
        asyncio.run(read_limited_body(None, _Arrived(raw), len(raw) - 1, 30.0, RequestLimits()))
    assert too_large.value.status == 413
    with pytest.raises(OpenAIError) as too_deep:
        deep = b"[" * 40 + b"]" * 40
        asyncio.run(read_limited_body(len(deep), _Arrived(deep), 1 << 24, 30.0, RequestLimits(max_depth=32)))
    assert too_deep.value.status == 400


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(alphabet='[]{}:,"\\ ab0', max_size=300).map(str.encode))
def test_a_body_within_the_byte_count_bounds_is_within_the_exact_check_too(raw):
    # within_by_counts may skip StructureCheck only where it could not refuse the body over a
    # limit; what it refuses as invalid JSON, the parser refuses too (a 400 either way)
    from protocol.openai_body import Body, within_by_counts

    limits = RequestLimits(max_depth=4, max_json_nodes=24, bytes_per_json_node=10_000)
    budget = limits.node_budget(len(raw))
    if not within_by_counts(raw, limits.max_depth, budget):
        return
    check = StructureCheck(limits, len(raw))
    try:
        check.feed(raw)
        check.finish()
    except OpenAIError as exc:
        assert exc.status == 400 and "not valid JSON" in str(exc), str(exc)
        skipped = Body(raw)
        skipped.structure_checked = True
        with pytest.raises(OpenAIError) as parsed:
            parse_json_body(skipped, limits)
        assert parsed.value.status == 400


def test_a_small_body_over_the_depth_still_gets_its_400_when_it_arrived_whole():
    deep = b'{"a":' * 33 + b"1" + b"}" * 33
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_limited_body(len(deep), _Arrived(deep), 1 << 24, 30.0, RequestLimits(max_depth=32)))
    assert info.value.status == 400
