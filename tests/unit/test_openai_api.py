"""protocol.openai_api: what a valid request becomes, and the exact 4xx every bad one gets."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    RequestLimits,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    parse_request,
)


def _raises(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args)
    return info.value


def test_error_body_has_openai_shape():
    assert error_body("bad", param="max_tokens") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": None}
    }


def test_completion_request_with_all_sampling_fields_is_parsed():
    req = parse_completion_request({
        "model": "tiny", "prompt": "hello", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "top_k": 40, "seed": 3, "stop": ["\n", "END"], "stop_token_ids": [2], "ignore_eos": True,
        "logprobs": 2, "n": 2, "stream": True, "stream_options": {"include_usage": True},
        "user": "u1", "session_id": "s1", "cache_salt": "salt", "lora_adapter": "ad",
    })
    assert isinstance(req, CompletionRequest)
    assert (req.model, req.prompt, req.stream, req.include_usage) == ("tiny", "hello", True, True)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.5, 0.9, 40, 3)
    assert (s.stop, s.stop_token_ids, s.ignore_eos, s.logprobs, s.n) == (["\n", "END"], [2], True, 2, 2)
    assert (req.user, req.session_id, req.cache_salt, req.lora_adapter) == ("u1", "s1", "salt", "ad")


def test_completion_defaults_follow_openai():
    req = parse_completion_request({"model": "m", "prompt": "x"})
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.logprobs, s.n, s.stop) == (16, 1.0, 1.0, 0, None, 1, [])
    assert (req.stream, req.include_usage) == (False, False)


def test_completion_prompt_forms():
    assert parse_completion_request({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion_request({"model": "m", "prompt": ["one"]}).prompt == "one"
    assert parse_completion_request({"model": "m", "prompt": [[4, 5]]}).prompt == [4, 5]


def test_chat_request_prefers_max_completion_tokens_and_maps_logprobs():
    req = parse_chat_request({
        "model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    })
    assert isinstance(req, ChatCompletionRequest)
    assert (req.sampling.max_tokens, req.sampling.logprobs) == (9, 3)
    assert req.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert len(req.messages) == 2


def test_chat_logprobs_true_without_top_logprobs_returns_only_the_sampled_token():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert req.sampling.logprobs == 0
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert (req.sampling.logprobs, req.sampling.max_tokens) == (None, None)


def test_vllm_top_k_minus_one_means_disabled():
    assert parse_completion_request({"model": "m", "prompt": "x", "top_k": -1}).sampling.top_k == 0


def test_neutral_values_of_unimplemented_fields_are_accepted():
    req = parse_completion_request({"model": "m", "prompt": "x", "frequency_penalty": 0,
                                    "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1,
                                    "echo": False, "suffix": None})
    assert req.sampling.n == 1


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"prompt": "x"}, "model", "'model' is required"),
        ({"model": "", "prompt": "x"}, "model", "must not be empty"),
        ({"model": 3, "prompt": "x"}, "model", "must be a string"),
        ({"model": "m" * 257, "prompt": "x"}, "model", "longer than 256"),
        ({"model": "m"}, "prompt", "'prompt' is required"),
        ({"model": "m", "prompt": 5}, "prompt", "string or a list of token ids"),
        ({"model": "m", "prompt": []}, "prompt", "must not be an empty list"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt", "Batched prompts"),
        ({"model": "m", "prompt": [1, -2]}, "prompt", "between 0 and 2147483647"),
        ({"model": "m", "prompt": [1, True]}, "prompt", "list of integers"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "between 1 and 1048576, got 0"),
        ({"model": "m", "prompt": "x", "max_tokens": -5}, "max_tokens", "got -5"),
        ({"model": "m", "prompt": "x", "max_tokens": 10**30}, "max_tokens", "between 1 and"),
        ({"model": "m", "prompt": "x", "max_tokens": "7"}, "max_tokens", "must be an integer"),
        ({"model": "m", "prompt": "x", "max_tokens": 7.0}, "max_tokens", "must be an integer"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
        ({"model": "m", "prompt": "x", "temperature": -0.1}, "temperature", "at least 0.0"),
        ({"model": "m", "prompt": "x", "temperature": 1e308}, "temperature", "at most 2.0"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", "greater than 0.0"),
        ({"model": "m", "prompt": "x", "top_k": -2}, "top_k", "between -1 and"),
        ({"model": "m", "prompt": "x", "seed": 2**64}, "seed", "between"),
        ({"model": "m", "prompt": "x", "n": 0}, "n", "between 1 and 8"),
        ({"model": "m", "prompt": "x", "n": 9}, "n", "between 1 and 8"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of", "not supported"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "between 0 and 20"),
        ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs", "must be an integer"),
        ({"model": "m", "prompt": "x", "stop": 3}, "stop", "string or a list of strings"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop", "must not be empty"),
        ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16"),
        ({"model": "m", "prompt": "x", "stop": ["a" * 1025]}, "stop", "limited to 1024"),
        ({"model": "m", "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "between 0 and"),
        ({"model": "m", "prompt": "x", "ignore_eos": 1}, "ignore_eos", "must be a boolean"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream", "must be a boolean"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
         "only allowed when 'stream' is true"),
        ({"model": "m", "prompt": "x", "stream": True, "stream_options": []}, "stream_options", "must be an object"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo", "not supported"),
        ({"model": "m", "prompt": "x", "suffix": "s"}, "suffix", "not supported"),
        ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({"model": "m", "prompt": "x", "user": ["u"]}, "user", "must be a string"),
        ({"model": "m", "prompt": "x", "cache_salt": 1}, "cache_salt", "must be a string"),
    ],
)
def test_bad_completion_fields_get_400_naming_the_param(body, param, fragment):
    err = _raises(parse_completion_request, body)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert fragment in err.message


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"model": "m"}, "messages", "'messages' is required"),
        ({"model": "m", "messages": "hi"}, "messages", "must be a list"),
        ({"model": "m", "messages": []}, "messages", "must not be empty"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]", "must be an object"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "'role' must be one of"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "one of"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "string, null or a list"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text", "string 'text'"),
        ({"model": "m", "messages": [{"role": "user", "content": [7]}]}, "messages[0].content[0]",
         "content parts must be objects"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name",
         "'name' must be a string"),
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": "f"}]}, "messages[0].tool_calls",
         "list of objects"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools", "must be a list"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function", "string 'name'"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice", "not supported"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         "top_logprobs", "requires 'logprobs'"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
         "top_logprobs", "between 0 and 20"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens", "between 1 and"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ],
)
def test_bad_chat_fields_get_400_naming_the_param(body, param, fragment):
    err = _raises(parse_chat_request, body)
    assert (err.status, err.param) == (400, param)
    assert fragment in err.message


def test_body_over_the_size_limit_is_413():
    err = _raises(parse_json_body, b'{"a": "' + b"x" * 100 + b'"}', RequestLimits(max_body_bytes=64))
    assert (err.status, err.code) == (413, "request_too_large")


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"a": Infinity}', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
        (b'{"prompt": "\\ud800"}', "lone surrogate"),
        (b'{"a": ' + b"[" * 33 + b"]" * 33 + b"}", "deeper than 32"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper than 32"),
    ],
)
def test_malformed_bodies_get_400(raw, fragment):
    err = _raises(parse_json_body, raw)
    assert err.status == 400
    assert fragment in err.message


def test_nesting_at_the_limit_is_accepted():
    raw = b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}"
    assert parse_json_body(raw) == {"a": json.loads(b"[" * 31 + b"]" * 31)}


def test_prompt_over_the_character_limit_is_400():
    err = _raises(parse_completion_request, {"model": "m", "prompt": "x" * 101}, RequestLimits(max_prompt_chars=100))
    assert (err.status, err.param) == (400, "prompt")


def test_messages_over_the_character_limit_are_400():
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 60}] * 2}
    err = _raises(parse_chat_request, body, RequestLimits(max_prompt_chars=100))
    assert (err.status, err.param) == (400, "messages")


def test_parse_request_dispatches_on_endpoint():
    assert isinstance(parse_request(b'{"model":"m","prompt":"p"}', False), CompletionRequest)
    chat = b'{"model":"m","messages":[{"role":"user","content":"c"}]}'
    assert isinstance(parse_request(chat, True), ChatCompletionRequest)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from([
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n", "stream",
    "stream_options", "user", "session_id", "cache_salt", "tools", "tool_choice", "best_of", "echo",
    "response_format", "logit_bias", "frequency_penalty",
])


@settings(max_examples=400, deadline=None)
@given(body=st.dictionaries(field_names, json_values, max_size=8), chat=st.booleans())
def test_any_generated_body_either_parses_or_raises_a_4xx(body, chat):
    raw = json.dumps(body).encode()
    try:
        parse_request(raw, chat)
    except OpenAIError as err:
        assert 400 <= err.status < 500
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_any_byte_string_either_parses_or_raises_a_4xx(raw):
    try:
        parse_request(raw, False)
    except OpenAIError as err:
        assert 400 <= err.status < 500
