"""Canonical rendering and chunk hashing: the bytes both router and worker hash."""
from __future__ import annotations

import pytest
import xxhash

from protocol import RenderError, chunk_hashes, namespace_seed, render_chat, render_completion


def test_chat_extension_renders_to_a_byte_prefix_extension():
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert render_chat(turn2).startswith(render_chat(turn1))


def test_tools_render_deterministically_whatever_the_key_order():
    a = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    b = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(msgs, a) == render_chat(msgs, b)
    assert render_chat(msgs, a) != render_chat(msgs)


def test_tool_order_change_changes_the_rendering():
    f = {"type": "function", "function": {"name": "f"}}
    g = {"type": "function", "function": {"name": "g"}}
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(msgs, [f, g]) != render_chat(msgs, [g, f])


def test_text_parts_render_like_the_equivalent_string():
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    assert render_chat([{"role": "user", "content": parts}]) == render_chat(
        [{"role": "user", "content": "hello world"}])


def test_inline_images_are_digested_and_distinguished():
    def msg(data: str) -> list[dict]:
        return [{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}]}]
    big = render_chat(msg("A" * 100_000))
    assert len(big) < 300
    assert render_chat(msg("AAAA")) != render_chat(msg("BBBB"))
    assert render_chat(msg("AAAA")) == render_chat(msg("AAAA"))


def test_tool_calls_and_tool_results_count():
    base = [{"role": "user", "content": "weather?"}]
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get", "arguments": "{\"city\":\"Oslo\"}"}}]}
    other = {**call, "tool_calls": [{**call["tool_calls"][0],
                                     "function": {"name": "get", "arguments": "{\"city\":\"Rome\"}"}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "5C"}
    assert render_chat(base + [call, result]) != render_chat(base + [other, result])
    assert render_chat(base + [call, result]).startswith(render_chat(base + [call]))


def test_unicode_and_empty_system_prompt():
    with_empty = render_chat([{"role": "system", "content": ""}, {"role": "user", "content": "héllo 🌍"}])
    without = render_chat([{"role": "user", "content": "héllo 🌍"}])
    assert with_empty != without
    assert "héllo 🌍".encode() in with_empty


def test_role_boundaries_cannot_be_confused():
    a = render_chat([{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}])
    b = render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}])
    assert a != b


def test_same_text_under_different_models_never_shares_hashes():
    data = render_completion("x" * 1000)
    h_a = chunk_hashes(data, 128, namespace_seed("model-a"))
    h_b = chunk_hashes(data, 128, namespace_seed("model-b"))
    h_salt = chunk_hashes(data, 128, namespace_seed("model-a", cache_salt="tenant-1"))
    h_lora = chunk_hashes(data, 128, namespace_seed("model-a", adapter="sql-lora"))
    assert len(h_a) == 7
    assert not set(h_a) & set(h_b)
    assert not set(h_a) & set(h_salt)
    assert not set(h_a) & set(h_lora)


def test_chain_hash_names_the_whole_prefix():
    seed = namespace_seed("m")
    a = chunk_hashes(b"A" * 128 + b"B" * 128, 128, seed)
    b = chunk_hashes(b"C" * 128 + b"B" * 128, 128, seed)
    assert a[1] != b[1]  # same second chunk, different history
    assert chunk_hashes(b"A" * 128 + b"B" * 100, 128, seed) == a[:1]  # partial chunk: no hash


def test_chain_hashes_are_the_protocols_values():
    # Router and workers must agree on these numbers forever: h_i = xxh3_64(chunk_i, seed=h_{i-1}).
    data = bytes(range(256)) * 3
    assert chunk_hashes(data, 128, 0x1234) == [
        0x05DFB33F34078BA9, 0x4171092A57D9F426, 0xFB4BD017C181F519,
        0xF9651D751F141B51, 0xE0009BE02A8D715B, 0x75642EBA8008A66D]


def test_chain_hashes_match_the_definition_at_every_length_and_limit():
    data = bytes((i * 7919) % 251 for i in range(3000))
    for chunk_size in (1, 16, 128, 512):
        for size in (0, chunk_size - 1, chunk_size, 3 * chunk_size + 5, len(data)):
            for limit in (None, 0, 2, 10_000):
                expected, h = [], 99
                for i in range(size // chunk_size):
                    h = xxhash.xxh3_64_intdigest(data[i * chunk_size:(i + 1) * chunk_size], seed=h)
                    expected.append(h)
                got = chunk_hashes(data[:size], chunk_size, 99, limit)
                assert got == (expected if limit is None else expected[:limit])
    assert chunk_hashes(memoryview(data), 128, 99) == chunk_hashes(data, 128, 99)


def test_completion_token_ids_and_text():
    assert render_completion("abc") == b"abc"
    assert render_completion(["abc"]) == b"abc"
    assert render_completion([1, 2]) != render_completion([1, 3])
    with pytest.raises(RenderError):
        render_completion(3)
    with pytest.raises(RenderError):
        render_chat([{"content": "no role"}])
