"""``--log-format json``: every line a router and a worker write is one JSON object whose fields
are the event's ``key=value`` pairs, the access log line included; ``text`` stays key=value."""
from __future__ import annotations

import json

import openai

from tests.support import free_port, processes, spawn, wait_for


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_router_and_worker_write_one_json_object_per_line(tmp_path):
    wport, rport = free_port(), free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--time-scale", "1000", "--served-model-name", "m",
                            "--sim-output-len", "4", "--port", str(wport), "--log-format", "json"],
                           tmp_path, "worker", port=wport))
        procs.append(spawn(["router", "--port", str(rport), "--worker", f"http://127.0.0.1:{wport}",
                            "--log-format", "json"], tmp_path, "router", port=rport, ready_path="/ready"))
        client = openai.OpenAI(base_url=procs[1].url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.with_raw_response.create(model="m", prompt="hello", max_tokens=4,
                                                            extra_headers={"X-Request-Id": "req-json-1"})
        assert reply.http_response.status_code == 200
        access = wait_for(lambda: [e for e in _json_lines(procs[1].output()) if e.get("event") == "access"],
                          timeout=10, what="the access line")[0]
        worker_lines = _json_lines(procs[0].output())
    assert (access["request_id"], access["status"], access["model"], access["logger"]) == (
        "req-json-1", 200, "m", "prefixlb.router.access")
    assert isinstance(access["duration_ms"], float) and access["prompt_tokens"] == 6
    assert access["message"].startswith("event=access request_id=req-json-1 ")
    ready = next(e for e in worker_lines if e.get("event") == "worker_ready")
    assert (ready["model"], ready["simulated"], ready["level"]) == ("m", "True", "info")
    assert ready["time"].endswith("+00:00")


def test_text_is_the_default_log_format(tmp_path):
    port = free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--port", str(port)], tmp_path, "worker", port=port))
        line = wait_for(lambda: [ln for ln in procs[0].output().splitlines() if "event=worker_ready" in ln],
                        timeout=10)[0]
    assert " INFO prefixlb.worker.server event=worker_ready worker=" in line
