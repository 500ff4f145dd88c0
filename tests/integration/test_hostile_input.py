"""Hostile and bad input against a real router process in front of a real (simulated) worker.

Every case gets a precise 4xx in OpenAI's shape -- never a 5xx, a hang or a crash -- and both
processes keep serving. API keys are on for both hops (the client's key is the router's; the
router sends the worker its own). The worker's own bad-input suite is test_worker_bad_input.py.
"""
from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.worker_client import call, is_openai_error
from tests.support import free_port, processes, spawn, wait_for

MODEL = "m"
CLIENT_KEY, WORKER_KEY = "client-key-1", "worker-key-9"
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
LIMIT = 65536


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hostile")
    wport, rport = free_port(), free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--served-model-name", MODEL, "--time-scale", "10",
                            "--kv-blocks", "512", "--max-model-len", "1024", "--sim-output-len", "8",
                            "--api-key", WORKER_KEY, "--port", str(wport), "--log-level", "warning"],
                           logs, "worker", port=wport))
        procs.append(spawn(["router", "--port", str(rport), "--worker", f"http://127.0.0.1:{wport}",
                            "--api-key", CLIENT_KEY, "--worker-api-key", WORKER_KEY, "--admin-token", "s3cret",
                            "--max-body-bytes", str(LIMIT), "--body-timeout", "1", "--log-level", "warning"],
                           logs, "router", port=rport))
        router, worker = procs[1], procs[0]
        wait_for(lambda: call(router.url + "/health").json["routable_workers"] == 1, 30, what="a routable worker")
        yield router, worker
        assert router.alive() and worker.alive()


def _post(url: str, body=None, raw: bytes | None = None, headers: dict | None = None, path="/v1/completions"):
    return call(url + path, "POST", body, raw=raw, headers={**AUTH, **(headers or {})}, timeout=60)


def _expect(reply, status: int, code: str | None = None, param: str | None = None):
    assert reply.status == status, reply.raw[:500]
    assert is_openai_error(reply), reply.raw[:500]
    err = reply.json["error"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


# Every route of the worker that needs its key: /tokenize and /v1/*/render run the tokenizer and a
# chat template, /health_generate the engine; only the probes stay open.
WORKER_KEYED_ROUTES = [
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions/render", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [104, 105]}),
    ("GET", "/health_generate", None),
    ("GET", "/get_server_info", None),
    ("GET", "/server_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_load", None),
]


@pytest.mark.parametrize("method,path,body", WORKER_KEYED_ROUTES, ids=[r[1] for r in WORKER_KEYED_ROUTES])
def test_the_worker_requires_its_api_key_on_every_route_but_its_probes(servers, method, path, body):
    _, worker = servers
    _expect(call(worker.url + path, method, body), 401, "missing_api_key")
    _expect(call(worker.url + path, method, body, headers={"Authorization": "Bearer x"}), 401, "invalid_api_key")
    assert call(worker.url + path, method, body, headers={"Authorization": f"Bearer {WORKER_KEY}"}).status == 200


def test_the_worker_probes_stay_open_without_a_key(servers):
    _, worker = servers
    assert [call(worker.url + path).status for path in ("/health", "/load", "/metrics")] == [200, 200, 200]


def test_an_authorization_header_that_is_not_utf8_is_refused_never_a_500(servers):
    router, worker = servers
    undecodable = {"Authorization": "Bearer \xff\xfe\x80"}  # http.client sends these as raw bytes
    _expect(call(router.url + "/v1/models", headers=undecodable), 401, "invalid_api_key")
    _expect(call(worker.url + "/v1/models", headers=undecodable), 401, "invalid_api_key")
    _expect(call(worker.url + "/tokenize", "POST", {"prompt": "x"}, headers=undecodable), 401, "invalid_api_key")
    _expect(call(router.url + "/admin/workers", headers=undecodable), 403, "invalid_token")
    assert "Traceback" not in router.output() + worker.output()


def test_a_body_of_many_tiny_values_in_an_unread_field_is_400_at_both_doors(servers):
    router, worker = servers
    count = (LIMIT - 100) // 3
    raw = b'{"model": "m", "prompt": "x", "junk": [' + b",".join([b"[]"] * count) + b"]}"
    _expect(_post(router.url, raw=raw), 400, "too_many_json_values")
    _expect(call(worker.url + "/v1/completions", "POST", raw=raw, headers={"Authorization": f"Bearer {WORKER_KEY}"}),
            400, "too_many_json_values")


def test_an_unread_field_nested_deeper_than_16_levels_is_400_naming_it(servers):
    router, _ = servers
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "junk": json.loads("[" * 17 + "]" * 17)}
    _expect(_post(router.url, body), 400, "nesting_too_deep", "junk")
    body["junk"] = json.loads("[" * 16 + "]" * 16)
    assert _post(router.url, body).status == 200


def test_the_router_requires_a_client_key_and_serves_with_it(servers):
    router, _ = servers
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    _expect(call(router.url + "/v1/completions", "POST", body), 401, "missing_api_key")
    _expect(call(router.url + "/v1/completions", "POST", body, headers={"Authorization": f"Bearer {WORKER_KEY}"}),
            401, "invalid_api_key")
    reply = _post(router.url, body)
    assert reply.status == 200 and reply.json["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("raw,status,code,param", [
    (b"{", 400, None, None),
    (b"\xff\xfe{}", 400, None, None),                                   # invalid UTF-8
    (b'{"model": "m", "prompt": "\\ud800"}', 400, None, None),            # a lone surrogate
    (b"[" * 100 + b"]" * 100, 400, None, None),                          # nesting
    (json.dumps({"model": "m", "prompt": {"a": [[[[[[[[1]]]]]]]]}}).encode(), 400, None, "prompt"),
    (json.dumps({"model": 7, "prompt": "x"}).encode(), 400, None, "model"),   # wrong types
    (json.dumps({"model": "m", "prompt": "x", "max_tokens": "5"}).encode(), 400, None, "max_tokens"),
    (json.dumps({"model": "m", "prompt": "x", "stream": "yes"}).encode(), 400, None, "stream"),
    (json.dumps({"model": "m", "prompt": "x", "max_tokens": 10**30}).encode(), 400, None, "max_tokens"),  # absurd
    (json.dumps({"model": "m", "prompt": "x", "max_tokens": -1}).encode(), 400, None, "max_tokens"),
    (json.dumps({"model": "m", "prompt": "x", "n": 10**6}).encode(), 400, None, "n"),
    (json.dumps({"model": "m", "prompt": "x", "temperature": 1e308}).encode(), 400, None, "temperature"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', 400, None, None),
    (b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None, None),
    (json.dumps({"model": "m" * 300, "prompt": "x"}).encode(), 400, None, "model"),  # field size
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model_not_found", "model"),
    (json.dumps({"model": "m", "prompt": "x" * (LIMIT + 1)}).encode(), 413, "request_too_large", None),
])
def test_bad_bodies_get_precise_4xx_errors(servers, raw, status, code, param):
    router, _ = servers
    _expect(_post(router.url, raw=raw), status, code, param)


def test_an_oversized_body_without_a_length_is_refused_as_it_streams_in(servers):
    router, _ = servers
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Authorization: Bearer " + CLIENT_KEY.encode() + b"\r\nContent-Type: application/json\r\n\r\n")
        chunk = b"a" * 16384
        try:
            for _ in range(LIMIT // len(chunk) + 4):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except OSError:
            pass  # the router may close the connection as soon as it has answered
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize("headers,status,code", [
    ({"X-Junk": "a" * 20_000}, 400, "malformed_request"),                   # one huge header
    ({f"X-Junk-{i}": "x" for i in range(300)}, 400, "malformed_request"),   # too many headers
    ({"X-Request-Id": "caf\u00e9"}, 400, "invalid_header"),                # not forwardable to a worker
    ({"X-Session-Id": "s" * 2000}, 400, "invalid_header"),
    ({"X-Prefixlb-Affinity": "1e999"}, 400, None),
    ({"Authorization": "Bearer " + "k" * 5000}, 401, "invalid_api_key"),
])
def test_header_abuse_gets_a_4xx_in_openai_shape(servers, headers, status, code):
    router, _ = servers
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    raw_headers = {**AUTH, **headers}
    reply = call(router.url + "/v1/completions", "POST", raw=body, headers=raw_headers)
    _expect(reply, status, code)


@pytest.mark.parametrize("headers", [{"X-Junk": "a" * 20_000}, {f"X-Junk-{i}": "x" for i in range(300)}])
def test_header_abuse_on_the_worker_gets_a_4xx_in_openai_shape_too(servers, headers):
    _, worker = servers
    _expect(call(worker.url + "/health", headers=headers), 400, "malformed_request")
    assert call(worker.url + "/health").status == 200


NO_KEY, OWN_KEY, WRONG_KEY = "none", "own", "wrong"
COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 1}


def _error(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# (method, path, key, body, status, Allow, error body): what both servers answer, byte for byte.
EDGE_CASES = [
    ("GET", "/nowhere", NO_KEY, None, 404, None, _error("Not Found", "not_found_error")),
    ("POST", "/v1/nowhere", OWN_KEY, COMPLETION, 404, None, _error("Not Found", "not_found_error")),
    ("GET", "/v1/completions", OWN_KEY, None, 405, "POST", _error("Method Not Allowed", "invalid_request_error")),
    ("DELETE", "/v1/chat/completions", OWN_KEY, None, 405, "POST",
     _error("Method Not Allowed", "invalid_request_error")),
    ("POST", "/v1/models", OWN_KEY, None, 405, "GET,HEAD", _error("Method Not Allowed", "invalid_request_error")),
    # Without a key, /v1/ says nothing, not even which paths exist.
    ("GET", "/v1/nowhere", NO_KEY, None, 401, None,
     _error("Missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error", "missing_api_key")),
    ("GET", "/v1/models", WRONG_KEY, None, 401, None,
     _error("Incorrect API key provided", "invalid_request_error", "invalid_api_key")),
    ("POST", "/v1/completions", OWN_KEY, {**COMPLETION, "max_tokens": 0}, 400, None,
     _error("'max_tokens' must be between 1 and 1048576, got 0", "invalid_request_error", None, "max_tokens")),
]


@pytest.mark.parametrize("method,path,key,body,status,allow,error", EDGE_CASES,
                         ids=[f"{c[0]} {c[1]} key={c[2]}" for c in EDGE_CASES])
def test_router_and_worker_answer_the_same_errors_at_their_http_edge(servers, method, path, key, body, status,
                                                                     allow, error):
    router, worker = servers
    replies = []
    for proc, own in ((router, CLIENT_KEY), (worker, WORKER_KEY)):
        headers = {} if key == NO_KEY else {"Authorization": f"Bearer {own if key == OWN_KEY else 'wrong'}"}
        reply = call(proc.url + path, method, body, headers=headers)
        replies.append((reply.status, reply.headers.get("allow"), reply.json))
    assert replies == [(status, allow, error)] * 2


def test_a_slow_client_is_cut_off_with_a_408(servers):
    router, _ = servers
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n"
                  b"Authorization: Bearer " + CLIENT_KEY.encode() + b"\r\n\r\n{\"model\"")
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("header,status", [(None, 401), ("Bearer wrong", 403), ("Basic s3cret", 403),
                                           ("Bearer s3cret", 200)])
def test_the_admin_api_is_refused_without_the_right_token(servers, header, status):
    router, _ = servers
    reply = call(router.url + "/admin/workers", headers={"Authorization": header} if header else {})
    assert reply.status == status
    if status != 200:
        assert is_openai_error(reply)


json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
             | st.text(max_size=30))
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                          max_size=3), max_leaves=8)
fields = {
    "model": st.sampled_from([MODEL, "other", ""]) | json_leaf,
    "prompt": st.text(max_size=300) | st.lists(st.integers(-5, 300), max_size=20) | json_value,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"])},
                                               optional={"content": st.text(max_size=60) | json_value}),
                         max_size=3) | json_value,
    "max_tokens": st.integers(-3, 40) | json_leaf, "temperature": st.floats(-1, 3) | json_leaf,
    "top_p": st.floats(-0.5, 1.5) | json_leaf, "n": st.integers(-1, 10) | json_leaf,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=4), max_size=3) | json_leaf,
    "stream": st.booleans() | json_leaf, "logprobs": st.integers(-1, 25) | st.booleans() | json_leaf,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_leaf,
    "cache_salt": st.text(max_size=10) | json_leaf, "user": json_leaf, "session_id": json_leaf,
    "lora_adapter": json_leaf, "tools": json_value,
}
header_names = st.sampled_from(["X-Prefixlb-Affinity", "X-Session-Id", "X-User-Id", "X-Request-Id"])
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40) | st.sampled_from(
    ["-1", "0.5", "nan", "inf", "1e400", "0x1", ""])


@st.composite
def requests(draw) -> tuple[str, dict, dict]:
    chat = draw(st.booleans())
    body: dict = {"model": MODEL, "max_tokens": draw(st.integers(1, 8))}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=80))}]
    else:
        body["prompt"] = draw(st.text(max_size=80))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(fields[name])
    headers = draw(st.dictionaries(header_names, header_values, max_size=2))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, headers


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=requests())
def test_fuzzed_requests_never_get_a_5xx_from_the_router(servers, req):
    router, _ = servers
    path, body, headers = req
    reply = _post(router.url, body, headers=headers, path=path)
    assert reply.status < 500, (body, headers, reply.raw[:300])
    if reply.status >= 400:
        assert is_openai_error(reply), reply.raw[:300]


def test_both_still_serve_valid_requests_after_all_of_the_above(servers):
    router, worker = servers
    for stream in (False, True):
        reply = _post(router.url, {"model": MODEL, "prompt": "still alive", "max_tokens": 3, "stream": stream})
        assert reply.status == 200
        if stream:
            assert reply.sse()[-1] == "[DONE]"
        else:
            assert reply.json["usage"]["completion_tokens"] == 3
    assert call(router.url + "/health").json["routable_workers"] == 1
    metrics = call(router.url + "/metrics").raw.decode()
    assert 'prefixlb_router_responses_total{code="500"}' not in metrics
    assert 'prefixlb_router_responses_total{code="502"}' not in metrics
