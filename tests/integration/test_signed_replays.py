"""Replays of a worker's own signed messages (issue 13): real Redis, real worker and router processes.

With a signing secret, every message a worker writes carries its incarnation (a random id per
process start), its start time and a growing number, all signed. Captured old messages written
back into Redis -- a load report, a KV event, a registration of a dead incarnation -- are
dropped and counted (``prefixlb_router_messages_dropped_total{kind="replay"}``) and change
nothing: the router's view stays the live worker's.
"""
from __future__ import annotations

import json
import time

import pytest
import redis

from protocol import RedisKeys
from protocol.signing import worker_key
from tests.integration.worker_client import call
from tests.support import free_port, spawn, wait_for

pytestmark = pytest.mark.timeout(300)

SECRET = "fleet-signing-secret-for-replay-tests"
TOKEN = "s3cret"


def _metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in call(url + "/metrics").raw.decode().splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _worker(logs, name: str, redis_url: str, prefix: str, port: int):
    return spawn(["worker", "--simulate", "--served-model-name", "m", "--time-scale", "10", "--port", str(port),
                  "--worker-id", "w0", "--redis", redis_url, "--redis-prefix", prefix,
                  "--advertise", f"http://127.0.0.1:{port}", "--heartbeat-interval", "2",
                  "--redis-signing-key", worker_key(SECRET, "w0"), "--log-level", "warning"], logs, name, port)


def _workers(router_url: str) -> list[dict]:
    reply = call(router_url + "/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == 200, reply.raw[:300]
    return reply.json["workers"] if isinstance(reply.json, dict) else reply.json


def test_replayed_reports_events_and_an_old_incarnations_registration_change_nothing(
        tmp_path_factory, redis_server_url, redis_prefix):
    logs = tmp_path_factory.mktemp("replays")
    keys = RedisKeys(redis_prefix)
    r = redis.Redis.from_url(redis_server_url)
    port_a, port_b, rport = free_port(), free_port(), free_port()
    worker_a = _worker(logs, "worker-a", redis_server_url, redis_prefix, port_a)
    router = spawn(["router", "--port", str(rport), "--redis", redis_server_url, "--redis-prefix", redis_prefix,
                    "--registry-interval", "0.2", "--health-interval", "0.5", "--redis-signing-secret", SECRET,
                    "--admin-token", TOKEN, "--log-level", "warning"], logs, "router", rport)
    worker_b = None
    try:
        wait_for(lambda: call(router.url + "/health").json["routable_workers"] == 1, 30, what="w0 joined")
        reply = call(router.url + "/v1/completions", "POST", {"model": "m", "prompt": "replay me " * 100,
                                                               "max_tokens": 2}, timeout=60)
        assert reply.status == 200, reply.raw[:300]
        wait_for(lambda: _metric(router.url, "prefixlb_router_kv_events_total", kind="stored") >= 1, 10,
                 what="stored events applied")
        # capture what an eavesdropper on Redis could have copied
        old_registration = r.get(keys.worker("w0"))
        old_load = r.get(keys.load("w0"))
        events = [fields[b"e"] for _, fields in r.xrange(keys.kv_events)]
        cleared = next(e for e in events if json.loads(e)["kind"] == "cleared")
        assert json.loads(old_load)["inc"] == json.loads(cleared)["inc"]
        applied = {kind: _metric(router.url, "prefixlb_router_kv_events_total", kind=kind)
                   for kind in ("stored", "cleared")}
        # a newer heartbeat (2 s apart) reaches the router; then the captured ones are written back
        time.sleep(2.5)
        assert r.get(keys.load("w0")) != old_load
        replays = _metric(router.url, "prefixlb_router_messages_dropped_total", kind="replay")
        r.xadd(keys.kv_events, {"e": cleared})  # would forget every prefix w0 holds
        r.set(keys.load("w0"), old_load, px=5000)
        wait_for(lambda: _metric(router.url, "prefixlb_router_messages_dropped_total", kind="replay")
                 >= replays + 2, 5, what="the replayed event and load report dropped")
        assert _metric(router.url, "prefixlb_router_kv_events_total", kind="cleared") == applied["cleared"]
        hits = _metric(router.url, "prefixlb_router_messages_dropped_total", kind="kv_event")
        assert hits == 0  # dropped as replays, not as malformed

        # worker A stops; B, a new incarnation of w0 at another address, takes its place
        worker_a.stop()
        worker_b = _worker(logs, "worker-b", redis_server_url, redis_prefix, port_b)
        wait_for(lambda: [w["url"] for w in _workers(router.url)] == [f"http://127.0.0.1:{port_b}"], 30,
                 what="B registered in A's place")
        replays = _metric(router.url, "prefixlb_router_messages_dropped_total", kind="replay")
        # A's old registration (A's address, A's incarnation) and its old events written back
        r.set(keys.worker("w0"), old_registration, px=5000)
        r.xadd(keys.kv_events, {"e": cleared})
        for e in events:
            r.xadd(keys.kv_events, {"e": e})
        wait_for(lambda: _metric(router.url, "prefixlb_router_messages_dropped_total", kind="replay")
                 >= replays + 2 + len(events), 5, what="A's registration and events dropped")
        for _ in range(10):  # across several registry syncs, B stays the one w0
            assert [w["url"] for w in _workers(router.url)] == [f"http://127.0.0.1:{port_b}"]
            time.sleep(0.1)
        reply = call(router.url + "/v1/completions", "POST", {"model": "m", "prompt": "after " * 50,
                                                               "max_tokens": 2}, timeout=60)
        assert reply.status == 200 and reply.headers.get("x-prefixlb-worker-id") == "w0"
    finally:
        r.close()
        router.stop()
        worker_a.stop()
        if worker_b is not None:
            worker_b.stop()
