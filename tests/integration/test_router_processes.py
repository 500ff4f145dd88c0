"""``prefixlb router --processes 2`` over real processes, real Redis and the official client:
both processes take connections on the one port, the port shows one /metrics view and one
admin API, a killed process is started again, SIGTERM ends them all, and a port that is taken
fails the command as it does with one process."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from tests.integration.worker_client import call
from tests.support import ROOT, free_port, processes, spawn, wait_for

TOKEN = "processes-test-token"
MODEL = "llama-3-8b"


def children(supervisor_pid: int) -> list[int]:
    """The pids of a process's children (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == supervisor_pid:
                out.append(int(entry))
    return sorted(out)


def sample(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_server_url, module_redis_prefix):
    root = tmp_path_factory.mktemp("router-processes")
    wport, rport = free_port(), free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--time-scale", "100", "--port", str(wport), "--worker-id", "pw0",
                            "--log-level", "warning"], root, "worker", port=wport, timeout=120))
        procs.append(spawn(["router", "--processes", "2", "--port", str(rport), "--worker",
                            f"http://127.0.0.1:{wport}", "--redis", redis_server_url, "--redis-prefix",
                            module_redis_prefix, "--admin-token", TOKEN, "--health-interval", "0.2",
                            "--shutdown-grace", "2", "--log-level", "info"], root, "router", port=rport))
        router = procs[-1]
        # The supervisor answers nothing itself: /health answered means a process listens; wait for both.
        wait_for(lambda: len(children(router.popen.pid)) == 2, 30, what="two router processes")
        wait_for(lambda: sample(call(router.url + "/metrics").raw.decode(), "prefixlb_router_processes_answering")
                 == 2.0, 60, what="both processes answering")
        yield router


def test_both_processes_take_connections_on_the_one_port_and_serve_the_openai_client(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    seen = set()
    for i in range(40):
        # A new client connection each time: the kernel spreads connections, not requests.
        raw = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=30) \
            .completions.with_raw_response.create(model=MODEL, prompt=f"the same system prompt, then {i}",
                                                  max_tokens=2)
        assert raw.parse().choices[0].text is not None
        seen.add(raw.headers["X-Prefixlb-Router-Process"])
    assert seen == {"0", "1"}
    assert client.models.list().data[0].id == MODEL


def answered(text: str) -> float:
    """Every answer the router counted, whatever its status."""
    return sum(float(v) for v in re.findall(r"^prefixlb_router_responses_total\{[^}]*\} (\S+)$", text, re.M))


def test_metrics_are_one_view_counters_summed_and_state_gauges_labelled_by_process(cluster):
    text = call(cluster.url + "/metrics").raw.decode()
    total = sum(float(v) for v in re.findall(r'^prefixlb_router_requests_total\{[^}]*worker="pw0"[^}]*\} (\S+)$',
                                             text, re.M))
    responses = answered(text)
    for i in range(10):
        openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=30) \
            .completions.create(model=MODEL, prompt=f"count me {i}", max_tokens=2)
    # Whichever process answers the scrape, the routed requests of both are in it.
    for _ in range(4):
        text = call(cluster.url + "/metrics").raw.decode()
        after = sum(float(v) for v in re.findall(
            r'^prefixlb_router_requests_total\{[^}]*worker="pw0"[^}]*\} (\S+)$', text, re.M))
        assert after == total + 10
    # Counted once, as one router would: the 10 answers and the 4 scrapes before the last one.
    # What the processes ask each other on their control sockets is no client's answer.
    assert answered(text) == responses + 10 + 4
    assert sample(text, "prefixlb_router_processes") == 2.0
    assert sample(text, "prefixlb_router_redis_up", '{process="0"}') == 1.0
    assert sample(text, "prefixlb_router_redis_up", '{process="1"}') == 1.0
    assert sample(text, "prefixlb_router_inflight_requests") == 0.0  # summed: no process label


def test_an_admin_change_reaches_every_process_at_once(cluster):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    reply = call(cluster.url + "/admin/config", "PUT", {"affinity": 0.55}, headers=auth)
    assert reply.status == 200 and reply.headers["x-prefixlb-processes-applied"] == "2/2"
    text = call(cluster.url + "/metrics").raw.decode()
    assert sample(text, "prefixlb_router_affinity", '{process="0"}') == 0.55
    assert sample(text, "prefixlb_router_affinity", '{process="1"}') == 0.55
    # Refused changes are refused once, replayed nowhere.
    bad = call(cluster.url + "/admin/config", "PUT", {"affinity": 7}, headers=auth)
    assert bad.status == 400 and "x-prefixlb-processes-applied" not in bad.headers
    # The token guards the replays as it guards the port.
    assert call(cluster.url + "/admin/config", "PUT", {"affinity": 0.1}, headers={}).status == 401
    usage = call(cluster.url + "/admin/usage", headers=auth)
    assert usage.status == 200 and usage.headers["x-prefixlb-processes-applied"] == "2/2"
    assert usage.json["total"]["requests"] >= 50  # both processes' ledgers: every request above


def test_a_killed_process_is_started_again_and_the_port_keeps_answering(cluster):
    first = children(cluster.popen.pid)
    os.kill(first[0], signal.SIGKILL)
    wait_for(lambda: len(children(cluster.popen.pid)) == 2 and children(cluster.popen.pid) != first, 30,
             what="the killed process started again")
    wait_for(lambda: sample(call(cluster.url + "/metrics").raw.decode(), "prefixlb_router_processes_answering")
             == 2.0, 60, what="the new process answering")
    for i in range(10):
        openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=2, timeout=30) \
            .completions.create(model=MODEL, prompt=f"after the restart {i}", max_tokens=2)
    assert "event=router_process_died" in cluster.output()


def test_sigterm_ends_every_process_and_the_supervisor_exits_0(cluster):
    pids = children(cluster.popen.pid)
    assert len(pids) == 2
    cluster.signal(signal.SIGTERM)
    assert cluster.popen.wait(timeout=30) == 0
    for pid in pids:
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
                 10, what=f"process {pid} gone")


def test_a_taken_port_fails_the_command_with_status_1(tmp_path, redis_server_url, redis_prefix):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "prefixlb", "router", "--processes", "2", "--port", str(port),
                               "--redis", redis_server_url, "--redis-prefix", redis_prefix,
                               "--startup-sync-timeout", "2"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot start" in done.stderr
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("args, message", [
    (["--processes", "2"], "needs --redis"),
    (["--processes", "2", "--redis", "redis://127.0.0.1:6379/0", "--port", "0"], "needs a fixed --port"),
    (["--processes", "0"], "processes"),
])
def test_settings_several_processes_cannot_run_with_are_refused(args, message):
    done = subprocess.run([sys.executable, "-m", "prefixlb", "router", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
