"""Huge bodies against a real router in front of a real (simulated) worker, at the default 16 MiB
limit: a hostile body is answered with a 400 while its client is still sending it (the structure
is checked as it arrives), and a large legitimate prompt full of brackets and commas in its text
is served by both."""
from __future__ import annotations

import json
import select
import socket

import pytest

from tests.integration.worker_client import call
from tests.support import free_port, processes, spawn, wait_for

MODEL = "m"
MIB = 1 << 20


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hostile-streamed")
    wport, rport = free_port(), free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--served-model-name", MODEL, "--time-scale", "10",
                            "--max-model-len", str(16 * MIB), "--sim-output-len", "2",
                            "--port", str(wport), "--log-level", "warning"], logs, "worker", port=wport))
        procs.append(spawn(["router", "--port", str(rport), "--worker", f"http://127.0.0.1:{wport}",
                            "--log-level", "warning"], logs, "router", port=rport))
        router, worker = procs[1], procs[0]
        wait_for(lambda: call(router.url + "/health").json["routable_workers"] == 1, 30, what="a routable worker")
        yield router, worker
        assert router.alive() and worker.alive()


def _send_until_answered(port: int, body: bytes, pause_after: int) -> tuple[bytes, int]:
    """Send the headers and the first ``pause_after`` bytes of ``body``, then wait for an answer
    without sending more; returns the answer and how many body bytes were sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        s.sendall(body[:pause_after])
        ready, _, _ = select.select([s], [], [], 20)
        assert ready, "no answer while the body was still being sent"
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            answer += data
        return answer, pause_after


def _hostile(size: int) -> bytes:
    return b'{"model":"m","prompt":"hi","max_tokens":1,"junk":[' + b"[]," * ((size - 64) // 3) + b"[]]}"


@pytest.mark.parametrize("door", ["router", "worker"])
def test_a_16mib_hostile_body_is_refused_before_the_client_has_sent_half(servers, door):
    router, worker = servers
    port = router.port if door == "router" else worker.port
    body = _hostile(16 * MIB)
    answer, sent = _send_until_answered(port, body, 6 * MIB)  # 1.1M values fit in ~3.3 MiB
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert json.loads(payload)["error"]["code"] == "too_many_json_values"
    assert sent < len(body) // 2


def test_a_deep_body_is_refused_from_its_first_chunk(servers):
    router, _ = servers
    answer, _ = _send_until_answered(router.port, b'{"model":"m","junk":' + b"[" * (16 * MIB - 64), 64 * 1024)
    assert answer.startswith(b"HTTP/1.1 400") and b"nesting is deeper than 32" in answer


TEXT = '[{"a":1},[],"\\"]"],'  # all structure to a naive count, one string to JSON


@pytest.mark.parametrize("door", ["router", "worker"])
def test_a_7mib_prompt_of_brackets_in_text_passes_the_body_check_to_the_models_context_limit(servers, door):
    router, worker = servers
    url = router.url if door == "router" else worker.url
    # 7 MiB of prompt text (2.5M "values" if strings were not skipped): parsed, rendered and
    # tokenized, then refused only for being longer than the simulated model's context
    prompt = TEXT * (7 * MIB // len(TEXT))
    reply = call(url + "/v1/completions", "POST", {"model": MODEL, "prompt": prompt, "max_tokens": 1},
                 timeout=120)
    assert reply.status == 400, reply.raw[:500]
    assert reply.json["error"]["code"] == "context_length_exceeded", reply.raw[:500]
    assert call(router.url + "/health").status == 200


@pytest.mark.parametrize("door", ["router", "worker"])
def test_a_prompt_of_brackets_in_text_within_the_context_is_served(servers, door):
    router, worker = servers
    url = router.url if door == "router" else worker.url
    prompt = TEXT * (300_000 // len(TEXT))
    reply = call(url + "/v1/completions", "POST", {"model": MODEL, "prompt": prompt, "max_tokens": 1},
                 timeout=120)
    assert reply.status == 200, reply.raw[:500]
    assert reply.json["usage"]["prompt_tokens"] > 100_000
