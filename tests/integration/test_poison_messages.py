"""Hostile Redis messages against live routers (issue 13): no loop ends, nothing is believed.

Real Redis, real worker and router processes. Poison is written straight into the keys the
routers read -- registrations, load reports, the KV-event stream, the index snapshot, the token
ratios -- and then one valid event: the routers must apply it, keep serving every request,
count what they dropped, and a router started afterwards must become ready.
"""
from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import redis

from protocol import KVEvent, RedisKeys
from tests.integration.worker_client import call
from tests.support import Proc, free_port, spawn, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def prefix(module_redis_prefix):
    return module_redis_prefix


def _router(redis_url: str, prefix: str, logs, name: str) -> Proc:
    port = free_port()
    proc = spawn(["router", "--port", str(port), "--redis", redis_url, "--redis-prefix", prefix,
                  "--registry-interval", "0.2", "--health-interval", "0.5", "--snapshot-interval", "1",
                  "--admin-token", "s3cret", "--log-level", "warning"], logs, name, port)
    wait_for(lambda: call(proc.url + "/health").json["routable_workers"] == 1, 30, what=f"{name} routing")
    return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_server_url, prefix):
    logs = tmp_path_factory.mktemp("poison")
    procs: list[Proc] = []
    try:
        port = free_port()
        worker = spawn(["worker", "--model", "tiny", "--port", str(port), "--worker-id", "w0", "--redis",
                        redis_server_url, "--redis-prefix", prefix, "--advertise", f"http://127.0.0.1:{port}",
                        "--heartbeat-interval", "0.2", "--log-level", "warning"], logs, "worker", port, timeout=120)
        procs.append(worker)
        routers = [_router(redis_server_url, prefix, logs, f"router{i}") for i in range(2)]
        procs.extend(routers)
        yield worker, routers, lambda name: procs.append(_router(redis_server_url, prefix, logs, name)) or procs[-1]
    finally:
        for p in procs:
            p.stop()


def _metric(router: Proc, name: str, **labels: str) -> float:
    text = call(router.url + "/metrics").raw.decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _complete(router: Proc, prompt: str) -> int:
    return call(router.url + "/v1/completions", "POST",
                {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60).status


def test_poison_in_every_key_stops_no_loop_and_a_valid_event_still_lands(cluster, redis_server_url, prefix):
    worker, routers, start_router = cluster
    keys = RedisKeys(prefix)
    r = redis.Redis.from_url(redis_server_url)
    stored_before = [_metric(x, "prefixlb_router_kv_events_total", kind="stored") for x in routers]
    # registrations and load reports: wrong types, another worker's id, a model that is a number
    poison_regs = {
        "evil-1": {"worker_id": "evil-1", "url": "http://127.0.0.1:1", "model": 5},
        "evil-2": {"worker_id": "w0", "url": "http://127.0.0.1:2", "model": "tiny"},  # names w0 under its key
        "evil\r\n3": {"worker_id": "evil\r\n3", "url": "http://127.0.0.1:3", "model": "tiny"},
    }
    # The load reports first: a router that reads the ids before their reports are written drops
    # the registrations and takes the ids out of the shared set, and would never read the reports.
    r.set(keys.load("evil-1"), json.dumps({"worker_id": "evil-1", "running": "1"}), ex=60)
    r.set(keys.load("evil-2"), json.dumps({"worker_id": "w0", "waiting": 10**6, "queued_prefill_tokens": 10**12,
                                           "prefill_tokens_per_s": 1.0}), ex=60)
    for key, reg in poison_regs.items():
        r.set(keys.worker(key), json.dumps(reg), ex=60)
        r.zadd(keys.workers, {key: 1e12})
    # KV events: a bad ts, hashes out of range, not JSON at all (an unknown worker's events are
    # taken while the router tracks fewer than MAX_EVENT_SOURCES sources: a new worker's first
    # events may come before its registration is read)
    for raw in ({"worker_id": "w0", "kind": "stored", "hashes": [1], "ts": "x"},
                {"worker_id": "w0", "kind": "stored", "hashes": [-1]},
                {"worker_id": "w0", "kind": "stored", "hashes": [2**64]},
                {"worker_id": f"random-{uuid.uuid4().hex}", "kind": "stored", "hashes": [7]}):
        r.xadd(keys.kv_events, {"e": json.dumps(raw)})
    r.xadd(keys.kv_events, {"e": b"\xff\xfe not json"})
    # ratios and entries in the snapshot a new router loads
    for router in routers:
        assert _complete(router, "warm up " * 50) == 200
    wait_for(lambda: all(_metric(x, "prefixlb_router_messages_dropped_total", kind="kv_event") >= 4 for x in routers),
             10, what="the poisoned events dropped and counted by both routers")
    # the first router to read an unreadable registration also removes it from the shared set
    wait_for(lambda: sum(_metric(x, "prefixlb_router_messages_dropped_total", kind="registration")
                         for x in routers) >= 3
             and sum(_metric(x, "prefixlb_router_messages_dropped_total", kind="load_report") for x in routers) >= 2,
             10, what="the poisoned registrations and reports dropped")
    # one valid event after the poison: applied by every router within 2 s
    valid = KVEvent(worker_id="w0", kind="stored", hashes=[123456789], seq=10**6)
    r.xadd(keys.kv_events, {"e": valid.to_json()})
    wait_for(lambda: all(_metric(x, "prefixlb_router_kv_events_total", kind="stored") > before
                         for x, before in zip(routers, stored_before)), 5.0, what="the valid event applied")
    for router in routers:
        health = call(router.url + "/health").json
        assert (health["redis"], health["routable_workers"], health["known_workers"]) == ("up", 1, 1)
        assert _metric(router, "prefixlb_router_loop_errors_total") == 0
        assert all(_complete(router, f"after the poison {i} " * 20) == 200 for i in range(20))
        # w0's load is its own: the report filed under evil-2's key that names w0 was refused
        assert _metric(router, "prefixlb_router_worker_pending_seconds", worker="w0") < 60
    r.close()
    newcomer = start_router("router-late")
    assert _complete(newcomer, "a late router serves " * 20) == 200


def test_a_poisoned_token_ratio_does_not_survive_a_restart(cluster, redis_server_url, prefix, monkeypatch):
    worker, routers, start_router = cluster
    keys = RedisKeys(prefix)
    r = redis.Redis.from_url(redis_server_url)
    # a snapshot whose ratios are poison (the router writes its own every second: overwrite
    # it with one carrying an absurd ratio, as a hostile writer could)
    from router.snapshot import decode, encode

    snap = decode(r.get(keys.index_snapshot))
    r.set(keys.index_snapshot, encode(snap.entries, snap.stream_id, snap.taken_at, snap.chunk_size,
                                      {**snap.ratios, "tiny": 1e300, "tiny (chat)": float("nan")}), ex=600)
    restarted = start_router("router-after-poison")
    statuses = [_complete(restarted, f"ratio {i} " * 30) for i in range(100)]
    assert statuses == [200] * 100
    ratio = re.search(r'prefixlb_router_tokens_per_byte\{model="tiny"\} (\S+)', call(restarted.url + "/metrics").raw.decode())
    assert ratio is not None and float(ratio.group(1)) <= 4.0
    r.close()


def test_a_router_added_as_a_worker_of_another_router_is_refused_instead_of_looping(tmp_path_factory):
    logs = tmp_path_factory.mktemp("loop")
    first_port, second_port = free_port(), free_port()
    first = spawn(["router", "--port", str(first_port)], logs, "router-a", port=first_port)
    second = spawn(["router", "--port", str(second_port), "--worker", first.url, "--worker",
                    f"http://127.0.0.1:{second_port}", "--health-interval", "0.5", "--admin-token", "s3cret"],
                   logs, "router-b", port=second_port)
    try:
        # both probed since the second router listens: the other router, and itself
        wait_for(lambda: all("a prefixlb router answers there" in w["last_error"] for w in call(
            second.url + "/admin/workers", headers={"Authorization": "Bearer s3cret"}).json["workers"]), 30,
                 what="both routers refused as workers")
        health = call(second.url + "/health").json
        assert (health["status"], health["routable_workers"]) == ("no_routable_workers", 0)
        reply = call(second.url + "/v1/completions", "POST", {"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert reply.status == 503 and reply.json["error"]["code"] == "no_workers"
    finally:
        first.stop()
        second.stop()


def test_a_poisoned_config_version_is_ignored_and_the_next_change_reaches_every_router(cluster, redis_server_url,
                                                                                      prefix):
    _, routers, _ = cluster
    keys = RedisKeys(prefix)
    r = redis.Redis.from_url(redis_server_url)
    admin = {"Authorization": "Bearer s3cret"}
    before = [call(x.url + "/admin/config", headers=admin).json["runtime"]["affinity"] for x in routers]
    # a clock-like or absurd version that would never lose a wall-clock comparison
    r.hset(keys.config, mapping={"version": "1e308", "affinity": "0.01"})
    time.sleep(1.0)  # five registry syncs (a negative: nothing shows a config that was not adopted)
    assert [call(x.url + "/admin/config", headers=admin).json["runtime"]["affinity"] for x in routers] == before
    reply = call(routers[0].url + "/admin/config", "PUT", {"affinity": 0.65}, headers=admin)
    assert reply.status == 200
    wait_for(lambda: all(call(x.url + "/admin/config", headers=admin).json["runtime"]["affinity"] == 0.65
                         for x in routers), 5, what="the change adopted by every router")
    assert int(r.hget(keys.config, "version")) >= 1
    r.close()


def test_with_a_signing_secret_only_what_a_worker_signed_itself_counts(tmp_path_factory, redis_server_url,
                                                                        redis_prefix):
    from protocol.signing import sign, worker_key

    secret = "fleet-signing-secret-for-tests"
    logs = tmp_path_factory.mktemp("signed")
    keys = RedisKeys(redis_prefix)
    wport, rport = free_port(), free_port()
    worker = spawn(["worker", "--model", "tiny", "--port", str(wport), "--worker-id", "w0", "--redis",
                    redis_server_url, "--redis-prefix", redis_prefix, "--advertise", f"http://127.0.0.1:{wport}",
                    "--heartbeat-interval", "0.2", "--redis-signing-key", worker_key(secret, "w0")],
                   logs, "worker", wport, timeout=120)
    router = spawn(["router", "--port", str(rport), "--redis", redis_server_url, "--redis-prefix", redis_prefix,
                    "--registry-interval", "0.2", "--health-interval", "0.5", "--redis-signing-secret", secret],
                   logs, "router", rport)
    r = redis.Redis.from_url(redis_server_url)
    try:
        # the signed worker self-registers (no --worker flag): it joins
        wait_for(lambda: call(router.url + "/health").json["routable_workers"] == 1, 30, what="w0 joined signed")
        assert _complete(router, "signed " * 300) == 200
        stored = _metric(router, "prefixlb_router_kv_events_total", kind="stored")
        assert stored >= 1  # its own (signed) KV events are applied
        cleared = _metric(router, "prefixlb_router_kv_events_total", kind="cleared")  # its start-up "cleared"
        # another worker, holding only its own key, writes as w0; an unsigned writer registers itself
        forged = sign(KVEvent(worker_id="w0", kind="cleared").to_dict(), worker_key(secret, "w1"))
        r.xadd(keys.kv_events, {"e": forged})
        r.xadd(keys.kv_events, {"e": KVEvent(worker_id="w0", kind="cleared").to_json()})
        r.set(keys.worker("intruder"), json.dumps({"worker_id": "intruder", "url": "http://127.0.0.1:9",
                                                   "model": "tiny"}), ex=60)
        r.zadd(keys.workers, {"intruder": 1e12})
        wait_for(lambda: _metric(router, "prefixlb_router_messages_dropped_total", kind="kv_event") >= 2
                 and _metric(router, "prefixlb_router_messages_dropped_total", kind="registration") >= 1, 10,
                 what="the forged and unsigned messages dropped")
        assert _metric(router, "prefixlb_router_kv_events_total", kind="cleared") == cleared
        assert call(router.url + "/health").json["known_workers"] == 1
        assert all(_complete(router, f"still signed {i} " * 40) == 200 for i in range(5))
    finally:
        r.close()
        router.stop()
        worker.stop()
