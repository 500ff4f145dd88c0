"""JSON from outside the process nested past the parser's depth is bad JSON like any other, never
a ``RecursionError`` (protocol/untrusted_json.py): ``[`` × 100,000 is 100 KB, and code that catches
``ValueError`` for "not JSON" lets a ``RecursionError`` through -- a worker's answer became the
router's 500 (found by tests/integration/test_hostile_worker_answers.py)."""
from __future__ import annotations

import json

import pytest

from protocol import LoadReport, MessageError, untrusted_json
from protocol.signing import verify
from router.http.booking import json_usage
from router.http.proxy import _status_failure
from router.http.sse import UsageTap
from router.routing.chat_tokens import vllm_conversation
from router.state import _drain_applies
from router.virtual_models.judges.format import JsonSchemaJudge
from worker.engine.chat_template import with_tool_call_objects
from worker.engine.errors import InvalidLoRAAdapterError
from worker.engine.lora.adapter import _header, _parse_config
from worker.server.api.tool_calls import HermesParser, Llama3JsonParser

DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_nesting_is_a_json_decode_error_and_shallow_json_parses():
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        untrusted_json.loads(DEEP)
    with pytest.raises(json.JSONDecodeError):
        untrusted_json.loads(DEEP.encode())
    assert untrusted_json.loads(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}


def test_every_reader_of_outside_json_reads_deep_nesting_as_bad_json():
    with pytest.raises(MessageError):  # a load report or KV event from Redis
        LoadReport.from_json(DEEP)
    with pytest.raises(ValueError):  # a signed message
        verify(DEEP, "secret")
    assert json_usage(DEEP.encode()) is None  # a worker's answer: no usage
    assert json_usage(b'{"usage": ' + DEEP.encode() + b"}") is None  # (an object's: read without detect_encoding)
    assert _status_failure(503, DEEP.encode()).kind == "status"  # a worker's 5xx body
    tap = UsageTap(strip=True)  # a worker's stream: the event passes as it came
    event = b'data: {"usage": ' + DEEP.encode() + b"}\n\n"
    assert tap.feed(event) == event and tap.usage is None
    assert _drain_applies(DEEP, "w1") is True  # a drain entry on Redis: read as an old router's, by URL
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}  # a client's tool call
    conversation = vllm_conversation([{"role": "assistant", "content": "", "tool_calls": [call]}], "string")
    assert conversation[0]["tool_calls"][0]["function"]["arguments"] == {}


def test_the_worker_reads_deep_nesting_as_bad_json_too():
    """A client's tool-call arguments (the router forwards them: a worker 500 there counted against
    every worker's breaker it reached), a model's tool-call output, an adapter's files."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    fixed = with_tool_call_objects([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert fixed[0]["tool_calls"][0]["function"]["arguments"] == {}
    for text in ('<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>', "<tool_call>" + DEEP):
        assert HermesParser().parse(text).tool_calls == []
    assert Llama3JsonParser().parse("{" + '"a": {' * 100_000 + "}" * 100_001).tool_calls == []
    with pytest.raises(InvalidLoRAAdapterError):
        _parse_config(DEEP.encode(), "a", 64)
    with pytest.raises(InvalidLoRAAdapterError):
        _header(len(DEEP).to_bytes(8, "little") + DEEP.encode(), "a")


def test_a_json_schema_judge_rejects_an_answer_too_deep_to_validate():
    judge = JsonSchemaJudge({"type": "array", "items": {"$ref": "#"}})
    assert judge.evaluate("[" * 900 + "]" * 900).reason == "schema_violation: (root): nested too deeply to validate"
    assert judge.evaluate(DEEP).reason == "invalid_json"
    assert judge.evaluate("[[], [[]]]").accept


def _outcome(f, text: str):
    try:
        return "ok", f(text)
    except (ValueError, RecursionError) as exc:  # the message and position too
        return type(exc).__name__, str(exc)


def test_scan_whole_answers_and_refuses_exactly_as_the_decoders_decode_on_random_texts() -> None:
    """The C scanner alone for a bare object; anything it does not finish goes to ``decode``."""
    import random

    from protocol.openai_body import _DECODER as BODY_DECODER
    from protocol.untrusted_json import _DECODER, scan_whole

    rng = random.Random(5)
    pieces = ['{', '}', '[', ']', '"a"', '"\\ud800"', ':', ',', '1', '-0.5e3', 'NaN', 'Infinity', 'null', 'true',
              ' ', '\n', '\t', '"x"', '{"usage": {"prompt_tokens": 3}}', '"', '\\', '\u00e9', '{}', '1e999']
    scanned = 0
    for _ in range(30_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))
        if rng.random() < 0.5:
            text = "{" + text + "}"
        for decoder in (_DECODER, BODY_DECODER):
            assert _outcome(lambda t: scan_whole(decoder, t), text) == _outcome(decoder.decode, text), repr(text)
        scanned += text[:1] == "{" and text[-1:] == "}"
    assert scanned > 10_000
    deep = '{"a":' + "[" * 100_000 + "]" * 100_000 + "}"
    assert _outcome(lambda t: scan_whole(_DECODER, t), deep)[0] == _outcome(_DECODER.decode, deep)[0] == "RecursionError"
