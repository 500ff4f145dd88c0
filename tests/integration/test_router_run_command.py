"""``prefixlb run`` (what ``make run`` starts): 2 tiny CPU workers and a router, stopped together."""
from __future__ import annotations

import signal
import socket

from tests.integration.worker_client import call
from tests.support import free_port, processes, spawn, wait_for


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_prefixlb_run_serves_through_the_router_and_stops_its_workers_on_sigterm(tmp_path):
    port = free_port()
    with processes() as procs:
        run = spawn(["run", "--port", str(port), "--admin-token", "s3cret"], tmp_path, "run", port, timeout=180)
        procs.append(run)
        wait_for(lambda: call(run.url + "/health").json["routable_workers"] == 2, 60, what="2 routable workers")
        reply = call(run.url + "/v1/completions", "POST", {"model": "tiny", "prompt": "Once upon a time",
                                                          "max_tokens": 4}, timeout=120)
        assert reply.status == 200 and reply.json["usage"]["prompt_tokens"] == 17
        assert reply.headers["x-prefixlb-worker"] in ("worker-1", "worker-2")
        workers = call(run.url + "/admin/workers", headers={"Authorization": "Bearer s3cret"}).json["workers"]
        ports = [int(w["url"].rsplit(":", 1)[1]) for w in workers]
        assert len(ports) == 2 and all(listening(p) for p in ports)
        assert "prefixlb is running" in run.output()

        run.signal(signal.SIGTERM)
        assert run.popen.wait(30) == 0
        wait_for(lambda: not any(listening(p) for p in ports), 20, what="the workers to stop")
