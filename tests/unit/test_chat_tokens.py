"""Chats rendered to the token ids a vLLM backend computes (router/routing/chat_tokens.py) in
transformers' template environment (protocol/hf_chat_template.py).

The live parity with vLLM's own /tokenize and prompt_token_ids is in
tests/integration/test_vllm_engines.py; here: the environment against transformers itself, and
vLLM's message rewriting rule by rule.
"""
from __future__ import annotations

import json

import pytest

from protocol.hf_chat_template import ChatTemplateError, render_chat_template
from router.routing.chat_tokens import (OPENAI_FORMAT, STRING_FORMAT, BackendTokenizer, ChatTokensError,
                                        detect_content_format, vllm_conversation)
from worker.engine.model.byte_tokenizer_files import CHAT_TEMPLATE, byte_tokenizer_json, tokenizer_config
from worker.engine.tokenizer import ByteTokenizer

# A Llama-3-like template: string content, a namespace, loop controls and a generation block.
LLAMA_LIKE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}<|start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|eot|>"
    "{% endfor %}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}{% generation %}<|start|>assistant\n\n{% endgeneration %}{% endif %}"
    "[{{ ns.n }}]"
)
MESSAGES = [{"role": "system", "content": "  <b>&</b> ünïcode  "}, {"role": "skip", "content": "x"},
            {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def backend() -> BackendTokenizer:
    return BackendTokenizer.from_files(byte_tokenizer_json(), tokenizer_config())


@pytest.mark.parametrize("template", [LLAMA_LIKE, CHAT_TEMPLATE])
def test_rendering_matches_transformers_apply_chat_template(template):
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"q": "<&>"}}}]
    for add in (True, False):
        want, _ = render_jinja_template(conversations=[MESSAGES], tools=tools, chat_template=template,
                                        add_generation_prompt=add, bos_token="<s>", eos_token="</s>")
        got = render_chat_template(template, MESSAGES, tools, add, special_tokens={"bos_token": "<s>",
                                                                                    "eos_token": "</s>"})
        assert got == want[0]
    assert '"q": "<&>"' in got  # tojson does not HTML-escape


def test_raise_exception_and_broken_templates_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="only user"):
        render_chat_template("{{ raise_exception('only user') }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", MESSAGES)
    assert render_chat_template("{{ strftime_now('%Y') | length }}", []) == "4"


def test_the_content_format_follows_whether_the_template_loops_over_content():
    assert detect_content_format(CHAT_TEMPLATE) == OPENAI_FORMAT
    assert detect_content_format("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}") == OPENAI_FORMAT
    assert detect_content_format(LLAMA_LIKE) == STRING_FORMAT
    assert detect_content_format("{% for %}") == STRING_FORMAT


def test_vllm_rewrites_messages_before_the_template_sees_them():
    messages = [
        {"role": "developer", "content": "rules", "extra": 1},
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b"], "name": "ann"},
        {"role": "assistant", "content": None, "reasoning": "think",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": [1]}"}},
                        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                        {"id": "3", "type": "function", "function": {"name": "h", "arguments": "[1]"}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}},
             {"id": "2", "type": "function", "function": {"name": "g", "arguments": {}}},
             {"id": "3", "type": "function", "function": {"name": "h", "arguments": {}}}]
    assert vllm_conversation(messages, STRING_FORMAT) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": calls, "reasoning": "think", "reasoning_content": "think"},
        {"role": "tool", "content": "r1\nr2", "tool_call_id": "1"},
        {"role": "assistant", "content": "done"},
    ]
    openai = vllm_conversation(messages, OPENAI_FORMAT, template="{# 'developer' #}")
    assert openai[0] == {"role": "developer", "content": [{"type": "text", "text": "rules"}]}
    assert openai[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert openai[2]["content"] == [] and openai[3]["content"] == "r1\nr2"
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == "{\"x\": [1]}"  # the request is not changed


@pytest.mark.parametrize("bad", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"content": "no role"}],
    [{"role": "user", "content": 3}],
    [{"role": "assistant", "content": "", "tool_calls": ["x"]}],
    "not a list",
])
def test_requests_that_cannot_be_rendered_as_the_backend_would_are_refused(backend, bad):
    with pytest.raises(ChatTokensError):
        backend.chat_token_ids(bad)


def test_the_saved_checkpoint_renders_chats_to_the_byte_tokenizers_ids(backend):
    byte = ByteTokenizer()
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "p"}]},
                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "ü"}]):
        assert backend.chat_token_ids(messages) == byte.encode(byte.apply_chat_template(messages))
    assert backend.prompt_token_ids("ab") == [256, 97, 98]
    no_template = BackendTokenizer.from_files(byte_tokenizer_json(), {})
    with pytest.raises(ChatTokensError, match="no chat template"):
        no_template.chat_token_ids([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTokensError, match="tokenizer.json"):
        BackendTokenizer.from_files("{}", {})


def test_a_named_default_template_list_and_dict_special_tokens_are_understood():
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}],
              "bos_token": {"content": "<s>", "special": True}}
    backend = BackendTokenizer.from_files(byte_tokenizer_json(), json.loads(json.dumps(config)))
    assert backend.render_chat([{"role": "user", "content": "x"}]) == "D<s>"
