"""Tool calls in a model's text (hermes and llama3_json), whole and streamed piece by piece."""
from __future__ import annotations

import json

import pytest

from worker.server.api.tool_calls import HermesParser, Llama3JsonParser, ToolCallStream, make_parser

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "parameters": {}}'


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_blocks_become_calls_and_the_text_before_them_content():
    parsed = HermesParser().parse(HERMES)
    assert parsed.content == "Let me check.\n"
    assert _calls(parsed) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    assert parsed.tool_calls[0].id.startswith("call_") and parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_llama3_json_answers_become_calls_with_no_content():
    parsed = Llama3JsonParser().parse("  " + LLAMA + "\n")
    assert parsed.content is None
    assert _calls(parsed) == [("get_weather", {"city": "Zürich"}), ("get_time", {})]


@pytest.mark.parametrize("parser, text", [
    ("hermes", "Plain answer, no calls."),
    ("hermes", 'Oops <tool_call>{"name": "f", "arguments": {"a": </tool_call>'),  # malformed JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3_json", "The weather is fine."),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),  # truncated
    ("llama3_json", '{"city": "Zürich"}'),  # JSON, but not a call
])
def test_text_that_is_not_a_well_formed_call_stays_content(parser, text):
    parsed = make_parser(parser).parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


def _stream(parser, text: str, size: int):
    s = ToolCallStream(make_parser(parser))
    sent = [s.add(text[i:i + size]) for i in range(0, len(text), size)]
    rest, calls = s.finish()
    return "".join(sent) + rest, calls, sent


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_hermes_sends_the_content_and_holds_the_calls_back_whatever_the_piece_size(size):
    content, calls, sent = _stream("hermes", HERMES, size)
    assert content == "Let me check.\n"
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert not any("<" in piece for piece in sent)  # not even a partial "<tool_call>" leaked


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_streamed_llama3_json_sends_nothing_for_a_call_and_everything_for_an_answer(size):
    content, calls, _ = _stream("llama3_json", LLAMA, size)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    content, calls, sent = _stream("llama3_json", " Sunny {today}.", size)
    assert content == " Sunny {today}." and calls == []
    assert "".join(sent).strip()  # sent as it came, not all at the end


def test_a_held_back_marker_prefix_that_is_not_a_call_is_released():
    s = ToolCallStream(HermesParser())
    assert s.add("a <tool") == "a "
    assert s.add("box> b") == "<toolbox> b"
    assert s.finish() == ("", [])
    s = ToolCallStream(HermesParser())
    assert s.add("ends with <tool_") == "ends with "
    assert s.finish() == ("<tool_", [])


def test_an_unknown_parser_name_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        make_parser("pythonic")
