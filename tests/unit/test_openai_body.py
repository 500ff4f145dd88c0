"""protocol.openai_body: a body's structure is bounded before it is parsed, so a hostile body costs
little to refuse (a node budget that grows with the body, the nesting depth, small and shallow
containers in the fields the server does not read), and large bodies are decoded off the loop."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

import protocol.openai_body as openai_body
from protocol.openai_api import (OpenAIError, RequestLimits, parse_chat_request, parse_completion_request,
                                 parse_json_body)
from protocol.openai_body import OFF_LOOP_BYTES, decode_off_loop


def _raises(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args)
    return info.value


def _junk(unit: bytes, size: int) -> bytes:
    """A completion body of about ``size`` bytes whose bulk is ``[unit, unit, ...]`` in a field
    the server ignores."""
    count = (size - 40) // (len(unit) + 1)
    return b'{"model":"m","prompt":"x","junk":[' + b",".join([unit] * count) + b"]}"


def test_the_node_budget_grows_with_the_body_up_to_a_cap():
    limits = RequestLimits()
    assert limits.node_budget(0) == 4096
    assert limits.node_budget(4 * 1024 * 1024) == 4096 + 1024 * 1024
    # The cap leaves room for a prompt of max_prompt_token_ids token ids.
    assert limits.node_budget(16 * 1024 * 1024) == limits.max_json_nodes == 1_048_576 + 65_536


@pytest.mark.parametrize("unit", [b"[]", b"{}", b"0", b'""'])
def test_a_2mib_body_of_tiny_values_is_refused_without_being_parsed(monkeypatch, unit):
    # The parser is never reached: the body is refused on its bytes alone.
    monkeypatch.setattr(openai_body.json, "loads", lambda *a, **k: pytest.fail("the body was parsed"))
    err = _raises(parse_json_body, _junk(unit, 2 * 1024 * 1024))
    assert (err.status, err.type, err.code) == (400, "invalid_request_error", "too_many_json_values")


def test_a_body_exactly_at_its_node_budget_is_accepted_and_one_more_value_is_refused():
    limits = RequestLimits(max_json_nodes=100)
    # The root, 3 keys, 3 values and the k list elements: 7 + k nodes.
    at_budget = {"model": "m", "prompt": "x", "junk": [0] * 93}
    assert parse_json_body(json.dumps(at_budget).encode(), limits) == at_budget
    over = json.dumps({"model": "m", "prompt": "x", "junk": [0] * 94}).encode()
    err = _raises(parse_json_body, over, limits)
    assert err.message == (f"Request body holds 101 JSON values and keys; a body of {len(over)} bytes may hold "
                           "at most 100")


def test_an_empty_container_is_one_value():
    body = {"junk": [[], {}, []]}  # the root, a key, the list and its three elements
    assert parse_json_body(json.dumps(body).encode(), RequestLimits(max_json_nodes=6)) == body
    assert _raises(parse_json_body, json.dumps(body).encode(), RequestLimits(max_json_nodes=5)).code == \
        "too_many_json_values"


def test_brackets_commas_and_escaped_quotes_inside_strings_are_not_counted():
    limits = RequestLimits(max_json_nodes=16, max_depth=3)
    body = {"model": "m", "prompt": '[[[[{{,,::"\\' * 1000 + '"', "stop": ["]]}}\\\\\""]}
    assert parse_json_body(json.dumps(body).encode(), limits) == body


@pytest.mark.parametrize("raw", [
    b'{"a": ' + b"[" * 33 + b"]" * 33 + b"}",
    b'{"a": ' + b"[{\"b\":" * 17 + b"0" + b"}]" * 17 + b"}",  # alternating lists and objects
    b'{"a": [' + b"[]," * 100 + b"[" * 32 + b"]" * 32 + b"]}",  # one deep branch among wide ones
])
def test_nesting_deeper_than_the_limit_is_refused_however_it_is_spelled(raw):
    err = _raises(parse_json_body, raw)
    assert (err.status, err.message) == (400, "JSON nesting is deeper than 32 levels")


def test_malformed_json_is_reported_as_malformed_not_as_deep():
    assert "not valid JSON" in _raises(parse_json_body, b'{"a": [}').message
    assert "not valid JSON" in _raises(parse_json_body, b'{"a": ]]]]}').message


def test_a_surrogate_pair_is_a_character_and_a_lone_half_is_refused():
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}
    assert parse_json_body(b'{"prompt": "\\\\ud800"}') == {"prompt": "\\ud800"}  # an escaped backslash
    for raw in (b'{"prompt": "\\ud800"}', b'{"prompt": "\\ude00\\ud83d"}', b'{"\\udc00": 1}'):
        assert "lone surrogate" in _raises(parse_json_body, raw).message


def test_the_small_containers_openai_clients_send_in_unread_fields_are_accepted():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"a": "b"},
            "modalities": ["text"], "prediction": {"type": "content", "content": [{"type": "text", "text": "x"}]},
            "web_search_options": {"user_location": {"type": "approximate", "approximate": {"city": "x"}}}}
    assert parse_chat_request(body).body is body


def test_an_unread_field_nesting_deeper_than_its_limit_is_refused_naming_it():
    limits = RequestLimits(max_ignored_depth=3)
    assert parse_completion_request({"model": "m", "prompt": "x", "extra": [[[1]]]}, limits).prompt == "x"
    err = _raises(parse_completion_request, {"model": "m", "prompt": "x", "extra": [[[[1]]]]}, limits)
    assert (err.status, err.param, err.code) == (400, "extra", "nesting_too_deep")
    # A field the server reads is bounded by its own rules, not by this one.
    assert parse_completion_request({"model": "m", "prompt": [[[[1]]]][0][0][0], "stream_options": None},
                                    limits).prompt == [1]


def test_unread_fields_together_may_hold_only_so_many_values_and_keys():
    limits = RequestLimits(max_ignored_nodes=10)
    b = {"k": 1, "l": [2, 3]}  # 2 keys, 2 values, 2 elements
    ok = {"model": "m", "prompt": "x", "a": [1, 2, 3, 4], "b": b}
    assert parse_completion_request(ok, limits).prompt == "x"
    err = _raises(parse_completion_request, {"model": "m", "prompt": "x", "a": [1, 2, 3, 4, 5], "b": b}, limits)
    assert (err.status, err.param, err.code) == (400, "b", "too_many_json_values")


def test_a_large_body_is_decoded_in_a_thread_and_a_small_one_on_the_loop():
    loop_thread = threading.get_ident()

    def decode(raw: bytes) -> int:
        return threading.get_ident()

    async def both() -> tuple[int, int]:
        return (await decode_off_loop(b" " * OFF_LOOP_BYTES, decode),
                await decode_off_loop(b" " * (OFF_LOOP_BYTES + 1), decode))

    small, large = asyncio.run(both())
    assert small == loop_thread and large != loop_thread
