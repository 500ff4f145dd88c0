"""Redis high availability: routers and workers on ``redis+sentinel://`` follow a failover.

Real processes on loopback: a Redis primary, its replica, three sentinels
(``redis-server --sentinel``), a worker and a router that reach Redis only through the
sentinels. Under load, the primary is killed (SIGKILL): no request fails, the sentinels promote
the replica, and the router and the worker carry on through it -- a worker's new KV events
reach the router again, and a runtime config change made after the failover is shared.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import redis

from tests.integration.worker_client import call
from tests.support import free_port, spawn, wait_for

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

SERVICE = "prefixlb-primary"


def _redis(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen([shutil.which("redis-server"), *args], stdout=fh, stderr=subprocess.STDOUT)


def _ping(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def sentinel_redis(tmp_path):
    primary, replica = free_port(), free_port()
    sentinels = [free_port() for _ in range(3)]
    procs = {"primary": _redis(["--port", str(primary), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(tmp_path)], tmp_path / "primary.log"),
             "replica": _redis(["--port", str(replica), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(tmp_path), "--replicaof", "127.0.0.1", str(primary)],
                               tmp_path / "replica.log")}
    for port in (primary, replica):
        wait_for(lambda: _ping(port), 10, what=f"redis on {port}")
    for i, port in enumerate(sentinels):
        conf = tmp_path / f"sentinel{i}.conf"
        conf.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                        f"sentinel failover-timeout {SERVICE} 5000\nsentinel parallel-syncs {SERVICE} 1\n")
        procs[f"sentinel{i}"] = _redis([str(conf), "--sentinel"], tmp_path / f"sentinel{i}.log")
    for port in sentinels:
        wait_for(lambda: _ping(port), 10, what=f"sentinel on {port}")
    # every sentinel has found the replica (so it can promote it)
    wait_for(lambda: all(redis.Redis(port=p).sentinel_slaves(SERVICE) for p in sentinels), 30,
             what="the sentinels to discover the replica")
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in sentinels) + f"/{SERVICE}"
    yield url, procs, (primary, replica), sentinels
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait(5)


def test_a_primary_killed_under_load_fails_no_request_and_everyone_follows_the_promoted_replica(
        sentinel_redis, tmp_path):
    url, procs, (primary, replica), sentinels = sentinel_redis
    wport, rport = free_port(), free_port()
    worker = spawn(["worker", "--model", "tiny", "--port", str(wport), "--worker-id", "w0", "--redis", url,
                    "--advertise", f"http://127.0.0.1:{wport}", "--heartbeat-interval", "0.2"],
                   tmp_path, "worker", wport, timeout=120)
    router = spawn(["router", "--port", str(rport), "--redis", url, "--registry-interval", "0.2",
                    "--health-interval", "0.5", "--admin-token", "s3cret-t0ken-for-tests"], tmp_path, "router", rport)
    try:
        wait_for(lambda: call(router.url + "/health").json["routable_workers"] == 1, 30, what="the worker joined")
        results: list[int] = []
        stop = threading.Event()

        def load() -> None:
            k = 0
            while not stop.is_set():
                results.append(call(router.url + "/v1/completions", "POST",
                                    {"model": "tiny", "prompt": f"request {k} " + "failover " * 40,
                                     "max_tokens": 2}, timeout=60).status)
                k += 1

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(results) >= 10, 60, what="load flowing")
            procs["primary"].send_signal(signal.SIGKILL)
            procs["primary"].wait(5)
            wait_for(lambda: redis.Redis(port=sentinels[0]).sentinel_get_master_addr_by_name(SERVICE)[1] == replica,
                     60, what="the replica promoted")
            # the router reaches the new primary again (its loops reconnect through the sentinels)
            wait_for(lambda: call(router.url + "/health").json["redis"] == "up", 60, what="the router back on Redis")
            sent = len(results)
            wait_for(lambda: len(results) >= sent + 10, 60, what="requests after the failover")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert results and set(results) == {200}
        # the worker publishes to the promoted replica, and the router reads it: new KV events land
        new_primary = redis.Redis(port=replica)
        wait_for(lambda: new_primary.zcard("prefixlb:workers") == 1, 20, what="the worker registered on the new primary")
        before = float(_metric(router, 'prefixlb_router_kv_events_total{kind="stored"}'))
        assert call(router.url + "/v1/completions", "POST", {"model": "tiny", "prompt": "after " * 300,
                                                             "max_tokens": 2}).status == 200
        wait_for(lambda: float(_metric(router, 'prefixlb_router_kv_events_total{kind="stored"}')) > before, 10,
                 what="a KV event through the new primary")
        # and a config change made now is shared through it
        reply = call(router.url + "/admin/config", "PUT", {"affinity": 0.55},
                     headers={"Authorization": "Bearer s3cret-t0ken-for-tests"})
        assert reply.status == 200 and reply.json.get("shared", True)
        assert new_primary.hget("prefixlb:config", "affinity") == b"0.55"
    finally:
        router.stop()
        worker.stop()


def _metric(router, name: str) -> str:
    for line in call(router.url + "/metrics").raw.decode().splitlines():
        if line.startswith(name + " "):
            return line.rsplit(" ", 1)[1]
    return "0"
