"""The worker renders chat prompts exactly as transformers' ``apply_chat_template`` does.

Each case loads one tokenizer directory twice -- with transformers (``AutoTokenizer``) and with
the worker's :class:`HFTokenizer` -- and compares the rendered text and the token ids
(``tokenize=True``: the template's own special tokens, no BOS added twice) on the Llama 3,
Qwen 2.5 and Mistral formats (tests/data/chat_templates; tool-call arguments given as OpenAI's
JSON strings reach the template as objects, as vLLM hands them) and on a template using the Jinja
features transformers adds: loop controls, ``strftime_now``, ``tojson`` arguments,
``raise_exception``, ``{% generation %}``, named templates and ``chat_template_kwargs``.
"""
from __future__ import annotations

import json

import pytest

from tests.chat_template_support import write_tokenizer
from worker.engine.errors import InvalidRequestError
from worker.engine.tokenizer import HFTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City, e.g. Zürich"}},
                   "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich"})}}

CONVERSATIONS = {
    "one user turn": ([{"role": "user", "content": "Hello!"}], None),
    "system and turns": ([{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello. "}, {"role": "user", "content": "2+2?"}], None),
    "tools, a call and its result": ([{"role": "user", "content": "Weather in Zürich?"},
                                      {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
                                      {"role": "assistant", "content": "18°C and sunny."},
                                      {"role": "user", "content": "Thanks"}], [WEATHER]),
}

FEATURES = """{%- set ns = namespace(seen=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% continue %}{% endif -%}
  {%- if ns.seen >= max_turns | default(10) %}{% break %}{% endif -%}
  {%- set ns.seen = ns.seen + 1 -%}
  {%- if m.role == 'assistant' %}{% generation %}[A]{{ m.content }}{% endgeneration %}
  {%- else %}[{{ m.role | upper }}]{{ m.content }}
  {%- endif %}
{% endfor -%}
{%- if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}{{ tools | tojson(separators=(',', ':')) }}{% endif -%}
{{ strftime_now('%Y') }}|{{ eos_token }}|{{ mood | default('plain') }}
{%- if messages[-1].content == 'forbidden' %}{{ raise_exception('no forbidden words') }}{% endif -%}
{%- if add_generation_prompt %}[A]{% endif %}"""


def _pair(tmp_path, family: str, **kwargs):
    from transformers import AutoTokenizer

    directory = write_tokenizer(tmp_path / family, family, **kwargs)
    return AutoTokenizer.from_pretrained(str(directory)), HFTokenizer(directory)


def _reference(hf, messages, tools, **kwargs):
    """transformers' rendering of the conversation vLLM hands the template: tool-call arguments
    as objects (OpenAI sends them as JSON strings)."""
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                 return_dict=False, **kwargs)
    return text, list(ids)


@pytest.mark.parametrize("family", ["llama3", "qwen2_5", "mistral"])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_a_model_familys_template_renders_the_text_and_ids_transformers_renders(tmp_path, family, case):
    messages, tools = CONVERSATIONS[case]
    hf, ours = _pair(tmp_path, family)
    text, ids = _reference(hf, messages, tools)
    assert ours.chat_template.render(messages, tools, add_generation_prompt=True) == text
    assert ours.encode_chat(messages, tools) == ids
    if family != "qwen2_5":  # the template's BOS text became the one BOS token, not BOS + its bytes
        assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1


def test_chat_template_kwargs_reach_the_template_as_in_transformers(tmp_path):
    hf, ours = _pair(tmp_path, "llama3")
    messages = [{"role": "user", "content": "What day is it?"}]
    text, ids = _reference(hf, messages, None, date_string="01 Jan 2030")
    assert "Today Date: 01 Jan 2030" in text
    assert ours.encode_chat(messages, template_kwargs={"date_string": "01 Jan 2030"}) == ids


def test_the_jinja_features_transformers_adds_render_the_same(tmp_path):
    hf, ours = _pair(tmp_path, "qwen2_5", template=FEATURES)
    messages = [{"role": "system", "content": "skipped"}, {"role": "user", "content": "one"},
                {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    for kwargs in ({}, {"max_turns": 2, "mood": "terse"}):
        text, ids = _reference(hf, messages, [WEATHER], **kwargs)
        assert ours.encode_chat(messages, [WEATHER], template_kwargs=kwargs) == ids
        assert ours.chat_template.render(messages, [WEATHER], True, kwargs) == text
    assert "[USER]one" in text and "[A]two" in text and "[USER]three" not in text and "|terse" in text


def test_a_template_that_raises_is_a_bad_request_with_the_templates_message(tmp_path):
    _, ours = _pair(tmp_path, "mistral")
    with pytest.raises(InvalidRequestError, match="conversation roles must alternate"):
        ours.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    _, features = _pair(tmp_path / "f", "qwen2_5", template=FEATURES)
    with pytest.raises(InvalidRequestError, match="no forbidden words"):
        features.encode_chat([{"role": "user", "content": "forbidden"}])


def test_named_templates_pick_tool_use_for_a_request_with_tools_as_transformers_does(tmp_path):
    named = {"default": "{% for m in messages %}<{{ m.content }}>{% endfor %}",
             "tool_use": "{{ tools | length }} tools:{% for m in messages %}<{{ m.content }}>{% endfor %}"}
    hf, ours = _pair(tmp_path, "qwen2_5", named=named)
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, [WEATHER]):
        text, ids = _reference(hf, messages, tools)
        assert ours.encode_chat(messages, tools) == ids
    assert text == "1 tools:<hi>"


def test_reserved_names_in_chat_template_kwargs_are_refused(tmp_path):
    _, ours = _pair(tmp_path, "llama3")
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs may not set messages"):
        ours.encode_chat([{"role": "user", "content": "x"}], template_kwargs={"messages": []})
