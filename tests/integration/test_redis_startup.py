"""Redis at start-up, as an operator meets it: a malformed ``--redis`` URL stops the router and the
worker with one clear line (exit 2, no traceback); an unreachable Redis is said once in the
worker's log and in its ``/health``, which turns ``connected`` when Redis answers."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.worker_client import call
from tests.support import ROOT, free_port, processes, spawn, wait_for


@pytest.mark.parametrize("command", ["worker", "router"])
def test_a_malformed_redis_url_is_one_clear_line_and_exit_status_2(command):
    done = subprocess.run([sys.executable, "-m", "prefixlb", command, "--redis", "redis://:pw@redis:port/0",
                           "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"prefixlb {command}: --redis: 'redis://:***@redis:port/0': "
                                   "the port is not a number from 1 to 65535")


def test_an_unreachable_redis_is_logged_once_and_shown_in_health(tmp_path):
    port, dead = free_port(), free_port()  # nothing listens on `dead`
    args = ["worker", "--simulate", "--time-scale", "1000", "--port", str(port),
            "--redis", f"redis://127.0.0.1:{dead}/0"]
    with processes() as procs:
        procs.append(spawn(args, tmp_path, "worker", port=port))
        health = wait_for(lambda: (h := call(procs[0].url + "/health").json)["redis"]["state"] == "unreachable" and h,
                          timeout=10, what="the worker to report Redis unreachable")
        assert "Connect" in health["redis"]["last_error"] and health["status"] == "ready"
        wait_for(lambda: "event=redis_unreachable" in procs[0].output(), timeout=10, what="the warning")
        wait_for(lambda: _failures(procs[0].url) >= 3, timeout=20, what="three failed connection attempts")
        assert procs[0].output().count("event=redis_unreachable") == 1  # said once, not every retry
        assert "Traceback" not in procs[0].output()


def _failures(url: str) -> float:
    for line in call(url + "/metrics").raw.decode().splitlines():
        if line.startswith("prefixlb_worker_redis_failures_total "):
            return float(line.split()[1])
    raise AssertionError("no prefixlb_worker_redis_failures_total in /metrics")


def test_a_reachable_redis_is_connected_in_health(tmp_path, redis_server_url, redis_prefix):
    port = free_port()
    args = ["worker", "--simulate", "--time-scale", "1000", "--port", str(port), "--redis", redis_server_url,
            "--redis-prefix", redis_prefix]
    with processes() as procs:
        procs.append(spawn(args, tmp_path, "worker", port=port))
        health = wait_for(lambda: (h := call(procs[0].url + "/health").json)["redis"]["state"] == "connected" and h,
                          timeout=10, what="the worker to connect to Redis")
        assert health["redis"]["last_error"] is None
    plain_port = free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--port", str(plain_port)], tmp_path, "plain", port=plain_port))
        assert call(procs[0].url + "/health").json["redis"] == {"state": "off"}
