"""Hostile and bad input against a live worker: each case a precise 4xx in OpenAI's shape, never a
5xx, and the worker keeps serving. The simulated engine stands in for the model (same server code)."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.worker_client import call, is_openai_error
from tests.support import free_port, processes, spawn
from worker.simulator.runner import SIM_TEXT

MODEL = "m"
MAX_LEN = 512


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    port = free_port()
    # Time scale 5: a decode step takes ~1.5 ms, so a long stream is still running while the
    # bad requests of a test arrive.
    args = ["worker", "--simulate", "--served-model-name", MODEL, "--time-scale", "5",
            "--kv-blocks", "256", "--max-model-len", str(MAX_LEN), "--sim-output-len", "8",
            "--max-body-bytes", "65536", "--body-timeout", "1", "--port", str(port)]
    with processes() as procs:
        procs.append(spawn(args, tmp_path_factory.mktemp("bad"), "bad-input-worker", port=port))
        yield procs[0].url


def _post(url: str, path: str, body=None, raw: bytes | None = None, **kw):
    return call(url + path, "POST", body, raw=raw, **kw)


def _expect(reply, status: int, param: str | None = None, code: str | None = None, fragment: str = ""):
    assert reply.status == status, reply.raw
    assert is_openai_error(reply), reply.raw
    err = reply.json["error"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert fragment in err["message"]


def test_malformed_json_is_400(worker):
    _expect(_post(worker, "/v1/completions", raw=b'{"model": "m", "prompt": '), 400, fragment="not valid JSON")


def test_missing_and_mistyped_fields_are_400_naming_the_field(worker):
    _expect(_post(worker, "/v1/completions", {"prompt": "x"}), 400, "model")
    _expect(_post(worker, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "9"}), 400, "max_tokens")
    _expect(_post(worker, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _expect(_post(worker, "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}), 400, "temperature")
    _expect(_post(worker, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "n": 99}), 400, "n")
    _expect(_post(worker, "/v1/chat/completions", {"model": MODEL, "messages": "hi"}), 400, "messages")


def test_unknown_model_is_404(worker):
    _expect(_post(worker, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model", "model_not_found")
    _expect(_post(worker, "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
            404, "model", "model_not_found")


def test_prompt_longer_than_the_context_is_400(worker):
    _expect(_post(worker, "/v1/completions", {"model": MODEL, "prompt": "x" * MAX_LEN}), 400, "prompt",
            "context_length_exceeded")
    _expect(_post(worker, "/v1/completions", {"model": MODEL, "prompt": "x" * 100, "max_tokens": 500}), 400,
            "max_tokens", "context_length_exceeded", fragment="101 in the prompt, 500 for the completion")


def test_token_ids_outside_the_vocabulary_are_400(worker):
    _expect(_post(worker, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 999]}), 400, "prompt",
            fragment="outside the vocabulary")


def test_non_text_content_parts_are_400_for_a_text_model(worker):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}
    _expect(_post(worker, "/v1/chat/completions", body), 400, "messages[0].content[1].type", "unsupported")


def test_oversized_bodies_are_413_whether_announced_or_streamed(worker):
    big = json.dumps({"model": MODEL, "prompt": "x" * 70_000}).encode()
    _expect(_post(worker, "/v1/completions", raw=big), 413, code="request_too_large")
    # Chunked transfer: no Content-Length to refuse early, the limit applies while reading.
    host, port = worker.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Content-Type: application/json\r\n\r\n")
        for _ in range(20):
            s.sendall(b"%x\r\n" % 8192 + b"y" * 8192 + b"\r\n")
        s.sendall(b"0\r\n\r\n")
        head = s.recv(65536).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413")


def test_invalid_utf8_deep_nesting_and_lone_surrogates_are_400(worker):
    _expect(_post(worker, "/v1/completions", raw=b'{"model": "m", "prompt": "\xff\xfe"}'), 400, fragment="UTF-8")
    deep = b'{"model": "m", "prompt": "x", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    _expect(_post(worker, "/v1/completions", raw=deep), 400, fragment="nesting")
    _expect(_post(worker, "/v1/completions", raw=b'{"model": "m", "prompt": "\\udc00"}'), 400, fragment="surrogate")


def test_unknown_paths_and_wrong_methods_get_openai_shaped_errors(worker):
    _expect(call(worker + "/v2/whatever"), 404)
    reply = call(worker + "/v1/completions")
    _expect(reply, 405)
    assert reply.headers["allow"] == "POST"


def test_a_slow_client_is_cut_off_with_408(worker):
    host, port = worker.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"")
        start = time.monotonic()
        head = s.recv(65536).decode(errors="replace")
    assert head.startswith("HTTP/1.1 408")
    assert time.monotonic() - start < 5


def test_header_abuse_is_refused_and_the_worker_stays_healthy(worker):
    reply = call(worker + "/health", headers={"X-Junk": "a" * 100_000})
    assert 400 <= reply.status < 500
    assert call(worker + "/health").status == 200


json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                          max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
                                          optional={"content": st.one_of(st.text(max_size=60), json_value)}),
                    max_size=3)
# Each field: plausible values first (so many requests pass validation and really generate),
# then hostile ones.
fields = {
    "model": st.sampled_from([MODEL, "other", ""]) | json_leaf,
    "prompt": st.text(max_size=200) | st.lists(st.integers(-5, 300), max_size=20) | json_value,
    "messages": messages | json_value,
    "max_tokens": st.integers(-3, 600) | json_leaf,
    "temperature": st.floats(-1, 3) | json_leaf, "top_p": st.floats(-0.5, 1.5) | json_leaf,
    "top_k": st.integers(-3, 100) | json_leaf, "seed": st.integers(-2**64, 2**64) | json_leaf,
    "n": st.integers(-1, 10) | json_leaf, "stop": st.text(max_size=5) | st.lists(st.text(max_size=4), max_size=3) | json_leaf,
    "stream": st.booleans() | json_leaf, "logprobs": st.integers(-1, 25) | st.booleans() | json_leaf,
    "top_logprobs": st.integers(-1, 25) | json_leaf, "ignore_eos": st.booleans() | json_leaf,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_leaf,
    "cache_salt": st.text(max_size=10) | json_leaf, "user": json_leaf,
}


@st.composite
def bodies(draw, chat: bool) -> dict:
    """A valid request with zero to three fields replaced by generated (often hostile) values."""
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 20))}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=80))}]
    else:
        body["prompt"] = draw(st.text(max_size=80))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(fields[name])
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), chat=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(worker, data, chat):
    body = data.draw(bodies(chat))
    reply = _post(worker, "/v1/chat/completions" if chat else "/v1/completions", body, timeout=60)
    assert reply.status < 500, (body, reply.raw)
    if reply.status >= 400:
        assert is_openai_error(reply), reply.raw
    elif not body.get("stream"):
        assert reply.json["usage"]["prompt_tokens"] > 0


def test_bad_requests_do_not_disturb_a_request_in_flight(worker):
    result: dict = {}

    def stream():
        result["reply"] = _post(worker, "/v1/completions", {"model": MODEL, "prompt": "steady", "max_tokens": 400,
                                                           "ignore_eos": True, "stream": True}, timeout=60)

    t = threading.Thread(target=stream)
    t.start()
    bad = [b"{", b'{"model": "m", "prompt": [-1]}', b'{"model": "m", "prompt": "x", "n": 0}', b"\xff"]
    statuses = {_post(worker, "/v1/completions", raw=bad[i % len(bad)]).status for i in range(40)}
    alive = t.is_alive()
    t.join(60)
    assert statuses == {400}
    assert alive, "the stream finished before the bad requests were sent; the test proves nothing"
    events = result["reply"].sse()
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == (SIM_TEXT * 4)[:400].decode()


def test_the_worker_still_serves_after_all_of_the_above(worker):
    reply = _post(worker, "/v1/completions", {"model": MODEL, "prompt": "still alive", "max_tokens": 3})
    assert reply.status == 200
    assert reply.json["usage"]["completion_tokens"] == 3
    assert call(worker + "/health").status == 200
