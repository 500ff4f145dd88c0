"""SIGTERM of a router with streams open: each client gets an SSE error event, never a silent cut.

A simulated worker streams slowly (a long answer at the H100 latency model's pace); the router
gets SIGTERM with a short ``--shutdown-grace``: the stream that outlives the grace ends with an
OpenAI-shaped error event (``shutting_down``) and ``data: [DONE]``, and a stream that finishes
within the grace is not touched.
"""
from __future__ import annotations

import http.client
import json
import signal
import threading

import pytest

from tests.integration.worker_client import call
from tests.support import free_port, spawn, wait_for

pytestmark = pytest.mark.timeout(120)


def _stream(port: int, max_tokens: int, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "llama-3-8b", "prompt": "tell me a long story", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    events = []
    try:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                out["events"] = events
    except (http.client.IncompleteRead, ConnectionError) as exc:
        out["cut"] = repr(exc)
    out["events"] = events
    conn.close()


def test_sigterm_ends_open_streams_with_an_error_event_after_the_grace(tmp_path):
    wport, rport = free_port(), free_port()
    worker = spawn(["worker", "--simulate", "--gpu", "H100-80G", "--port", str(wport)],
                   tmp_path, "worker", wport, timeout=120)
    router = spawn(["router", "--port", str(rport), "--worker", worker.url, "--shutdown-grace", "1"],
                   tmp_path, "router", rport)
    try:
        wait_for(lambda: call(router.url + "/health").json["routable_workers"] == 1, 30, what="the worker routable")
        long_stream, short_stream = {}, {}
        threads = [threading.Thread(target=_stream, args=(rport, 4000, long_stream)),
                   threading.Thread(target=_stream, args=(rport, 20, short_stream))]
        for t in threads:
            t.start()
        wait_for(lambda: len(long_stream.get("events", [])) >= 3, 30, what="the long stream flowing")
        router.signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert router.popen.wait(30) == 0
        assert long_stream["status"] == 200 and "cut" not in long_stream
        assert long_stream["events"][-1] == "[DONE]"
        error = json.loads(long_stream["events"][-2])["error"]
        assert (error["code"], error["type"]) == ("shutting_down", "service_unavailable_error")
        assert len(long_stream["events"]) < 4000  # it was ended, not finished
        # the short one finished within the grace: a normal end
        assert short_stream["events"][-1] == "[DONE]"
        assert all("error" not in e for e in short_stream["events"][:-1])
    finally:
        router.stop()
        worker.stop()
