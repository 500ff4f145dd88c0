"""Chaos: real processes (4 simulated workers, 2 routers, a private Redis) broken under load.

Streaming and non-streaming clients run throughout (``chaos_cluster.LoadGenerator``) while a
worker is killed (``kill -9``), stopped (``SIGSTOP``), Redis is stopped and restarted empty, a
router is restarted, and a worker is added. What must hold, each time:

* a request that had not started streaming never fails (it is retried elsewhere);
* a stream cut by a failure ends with an SSE error event and ``[DONE]`` -- never silently;
* the fleet routes around the failure (a killed worker within one health interval) and takes the
  worker back when it returns.

The fast variants run in ``make test`` (about two minutes); ``make test-slow`` adds the long
ones (``-m slow``: a 30 s Redis outage, longer and heavier load).
"""
from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest

from router.routing.prompt import prompt_key
from router.routing.ring import WorkerRing
from tests.integration.chaos_cluster import ADMIN, MODEL, LoadGenerator, chaos_cluster, document, metric
from tests.integration.worker_client import call
from tests.support import wait_for

pytestmark = pytest.mark.chaos

WORKERS = {"w0", "w1", "w2", "w3"}
HEALTH_INTERVAL, HEALTH_JITTER = 2.0, 0.1
ONE_INTERVAL = HEALTH_INTERVAL * (1 + HEALTH_JITTER)  # the longest gap between two probes
WORKER_ARGS = ["--time-scale", "1", "--heartbeat-interval", "0.2", "--drain-timeout", "5", "--log-level", "warning"]
ROUTER_ARGS = ["--admin-token", "s3cret", "--registry-interval", "0.2", "--health-interval", str(HEALTH_INTERVAL),
               "--health-jitter", str(HEALTH_JITTER),
               "--health-timeout", "0.5", "--snapshot-interval", "2", "--prewarm-top", "8", "--log-level", "info"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with chaos_cluster(tmp_path_factory.mktemp("chaos"), 4, 2, WORKER_ARGS, ROUTER_ARGS) as c:
        yield c


@pytest.fixture
def healthy(cluster):
    """Each test starts from, and leaves, the whole fleet healthy on both routers."""
    cluster.wait_routable(WORKERS)
    yield cluster


def _urls(cluster) -> list[str]:
    return [r.url for r in cluster.routers]


class HeldStream(threading.Thread):
    """One long stream through a router, held open in a thread: where it went, what it got."""

    def __init__(self, url: str, session: str, tokens: int = 1500) -> None:
        super().__init__(daemon=True)
        self.url, self.session, self.tokens = url, session, tokens
        self.started = threading.Event()
        self.worker = ""
        self.raw = b""
        host, port = self.url.split("//")[1].split(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def close(self) -> None:
        """Hang up (from another thread): the reading thread ends."""
        if self._conn.sock is not None:
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        self.join(30)

    def run(self) -> None:
        conn = self._conn
        body = {"model": MODEL, "prompt": f"A long story for session {self.session}.", "max_tokens": self.tokens,
                "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Session-Id": self.session})
        resp = conn.getresponse()
        self.worker = resp.getheader("X-Prefixlb-Worker", "")
        self.started.set()
        try:
            self.raw = resp.read()
        except http.client.IncompleteRead as exc:  # a cut stream: what the client got
            self.raw = exc.partial
        except OSError:
            pass  # closed by this test
        finally:
            conn.close()

    def events(self) -> list:
        out = []
        for event in self.raw.split(b"\n\n"):
            if event.startswith(b"data: "):
                out.append("[DONE]" if event[6:] == b"[DONE]" else json.loads(event[6:]))
        return out


def hold_stream(url: str, avoid: set[str] = frozenset()) -> HeldStream:
    """A long stream through the router at ``url``, held open; where it landed is ``.worker``
    (a test then breaks that worker: which one does not matter, that a stream is on it does)."""
    for i in range(50):
        held = HeldStream(url, f"held-{time.time()}-{i}")
        held.start()
        assert held.started.wait(60), "the held stream did not start"
        if held.worker not in avoid:
            return held
        held.close()
    raise AssertionError(f"every stream landed on {sorted(avoid)}")


def assert_no_unannounced_failures(outcomes) -> list:
    """Every request succeeded, or was a stream cut after its first byte that said so; returns those."""
    broken = [o for o in outcomes if not o.ok and not o.clean_failure]
    assert broken == [], broken[:5]
    return [o for o in outcomes if not o.ok]


@pytest.mark.parametrize("load_s", [3.0, pytest.param(20.0, marks=pytest.mark.slow)])
def test_kill_9_of_a_worker_under_load_fails_only_streams_it_was_serving_and_traffic_moves_within_one_health_interval(
        healthy, load_s):
    cluster = healthy
    held = hold_stream(cluster.routers[0].url)
    victim = held.worker
    with LoadGenerator(_urls(cluster), concurrency=8) as load:
        wait_for(lambda: len(load.outcomes) >= 20, 60, what="load to run")
        killed_at = time.time()
        cluster.workers[victim].popen.kill()
        wait_for(lambda: all(victim not in cluster.routable(r) for r in cluster.routers), ONE_INTERVAL + 1,
                 interval=0.05, what="both routers to stop routing to the killed worker")
        out_at = time.time()
        time.sleep(load_s)  # traffic keeps flowing on the three survivors
    held.join(60)
    failures = assert_no_unannounced_failures(load.outcomes)
    assert all(o.worker == victim and o.started < out_at for o in failures), failures[:5]
    assert not [o for o in load.since(out_at) if o.worker == victim]
    assert len(load.since(out_at)) >= 10
    events = held.events()  # the stream it was serving: told, not truncated
    assert events[-2]["error"]["code"] == "upstream_failed" and events[-1] == "[DONE]"
    # Within one health interval: by its first request there, or else its next probe (a refused
    # connection opens the breaker at once); + 0.25 s for this test's own polling.
    assert out_at - killed_at <= ONE_INTERVAL + 0.25
    cluster.start_worker(victim)  # back on the same address with an empty cache: it rejoins
    cluster.wait_routable(WORKERS)


@pytest.mark.parametrize("stopped_s", [1.0, pytest.param(15.0, marks=pytest.mark.slow)])
def test_sigstop_of_a_worker_is_a_hang_the_breaker_ends_and_sigcont_brings_it_back(healthy, stopped_s):
    cluster = healthy
    held = hold_stream(cluster.routers[0].url)
    victim = held.worker
    proc = cluster.workers[victim]
    with LoadGenerator(_urls(cluster), concurrency=8) as load:
        wait_for(lambda: len(load.outcomes) >= 20, 60, what="load to run")
        proc.signal(signal.SIGSTOP)
        try:
            wait_for(lambda: all(cluster.states(r).get(victim) in ("unhealthy", None) for r in cluster.routers),
                     30, interval=0.1, what="the breakers to take the stopped worker out")
            out_at = time.time()
            time.sleep(stopped_s)
            prewarmed = sum(metric(r, 'prefixlb_router_prewarm_requests_total{outcome="ok"}') for r in cluster.routers)
        finally:
            proc.signal(signal.SIGCONT)
        back_at = time.time()
        cluster.wait_routable(WORKERS)  # half-open, then closed again by good probes and requests
    held.join(60)
    failures = assert_no_unannounced_failures(load.outcomes)
    assert all(o.worker == victim for o in failures), failures[:5]
    assert not [o for o in load.outcomes if out_at + 1 < o.started < back_at and o.worker == victim]
    events = held.events()
    assert events[-2]["error"]["code"] == "upstream_failed" and events[-1] == "[DONE]"
    assert "aborted" in events[-2]["error"]["message"]  # the breaker ended it, not --read-timeout
    # Back in rotation, and serving: the routers re-warmed it (they had dropped what it held).
    assert sum(metric(r, 'prefixlb_router_prewarm_requests_total{outcome="ok"}') for r in cluster.routers) > prewarmed


@pytest.mark.parametrize("outage_s", [4.0, pytest.param(30.0, marks=pytest.mark.slow)])
def test_redis_stopped_under_load_fails_no_request_and_the_routers_resynchronise_when_it_returns(
        healthy, outage_s):
    cluster = healthy
    with LoadGenerator(_urls(cluster), concurrency=8) as load:
        wait_for(lambda: len(load.outcomes) >= 20, 60, what="load to run")
        cluster.redis.stop()
        wait_for(lambda: all(call(r.url + "/health").json["redis"] == "down" for r in cluster.routers), 30,
                 what="the routers to notice")
        time.sleep(outage_s)
        cluster.redis.start()  # empty: no persistence, as a crashed cache node comes back
        wait_for(lambda: all(call(r.url + "/health").json["redis"] == "up" for r in cluster.routers), 60,
                 interval=0.1, what="the routers to reconnect")
        resumed = time.time()
        wait_for(lambda: len(load.since(resumed)) >= 20, 60, what="load after the outage")
    assert [o for o in load.outcomes if not o.ok] == []  # not one request failed because of Redis
    for router in cluster.routers:  # each checked the stream for a gap when Redis came back
        assert metric(router, "prefixlb_router_redis_resyncs_total") >= 1
    cluster.wait_routable(WORKERS)  # the workers registered again
    # KV events flow through the new Redis: what one router routes, the other learns.
    a, b = cluster.routers
    prompt = f"A contract nobody has seen before ({time.time()}). " * 60
    stored_before = metric(b, 'prefixlb_router_kv_events_total{kind="stored"}')
    first = call(a.url + "/v1/completions", "POST", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert first.status == 200
    wait_for(lambda: metric(b, 'prefixlb_router_kv_events_total{kind="stored"}') > stored_before, 30,
             what="router b to receive the stored event")
    second = call(b.url + "/v1/completions", "POST", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert (second.headers["x-prefixlb-worker"], second.headers["x-prefixlb-route-reason"]) == (
        first.headers["x-prefixlb-worker"], "prefix")
    assert second.json["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_restarted_router_sends_its_first_requests_to_the_same_workers_as_before(healthy):
    cluster = healthy
    router = cluster.routers[0]
    ring = WorkerRing(sorted(WORKERS))
    # Documents placed where a cold router would *not* put them: each first arrives in a session
    # (placed by the session's ring position); those that landed off their own ring position
    # tell a warm router (it follows the cache) from a cold one (it follows the ring).
    placed = []
    for i in range(12):
        prompt = f"Restart probe {i} at {time.time()}: " + document(100 + i)
        owner = ring.owner(prompt_key({"model": MODEL, "prompt": prompt}, False, 128, 8).ring_key)
        reply = call(router.url + "/v1/completions", "POST", {"model": MODEL, "prompt": prompt, "max_tokens": 1},
                     headers={"X-Session-Id": f"restart-{i}-{time.time()}"})
        assert reply.status == 200
        if reply.headers["x-prefixlb-worker"] != owner:
            placed.append((prompt, reply.headers["x-prefixlb-worker"]))
    assert len(placed) >= 3, "too few documents placed off their ring position to prove anything"

    def route(url: str) -> list[tuple[str, str]]:
        replies = [call(url + "/v1/completions", "POST", {"model": MODEL, "prompt": p, "max_tokens": 1})
                   for p, _ in placed]
        assert all(r.status == 200 for r in replies)
        return [(r.headers["x-prefixlb-worker"], r.headers["x-prefixlb-route-reason"]) for r in replies]

    expected = [(worker, "prefix") for _, worker in placed]
    assert route(router.url) == expected
    router.stop()  # SIGTERM: it writes a last snapshot
    restarted = cluster.start_router(0)
    assert route(restarted.url) == expected  # from its very first request


def test_a_worker_added_under_load_takes_traffic_and_with_prewarm_its_first_requests_hit(healthy):
    cluster = healthy
    with LoadGenerator(_urls(cluster), concurrency=8, stream_tokens=16) as load:
        wait_for(lambda: len(load.outcomes) >= 80, 60, what="load to make the documents hot")
        cluster.start_worker("w4")
        wait_for(lambda: all("w4" in cluster.routable(r) for r in cluster.routers), 60, interval=0.1,
                 what="both routers to route to the new worker")
        wait_for(lambda: len([o for o in load.outcomes if o.worker == "w4"]) >= 8, 60,
                 what="the new worker to take traffic")
    assert [o for o in load.outcomes if not o.ok] == []
    prewarm_ok = sum(metric(r, 'prefixlb_router_prewarm_requests_total{outcome="ok"}') for r in cluster.routers)
    assert prewarm_ok >= 8
    first = sorted((o for o in load.outcomes if o.worker == "w4"), key=lambda o: o.started)[:8]
    # Every prompt is one of the 8 hot documents plus a new question: pre-warmed, the document hits.
    assert [o.cached_tokens >= 2048 - 16 for o in first] == [True] * 8
    cluster.workers["w4"].stop()  # SIGTERM: it drains and deregisters
    wait_for(lambda: all("w4" not in cluster.states(r) for r in cluster.routers), 60,
             what="the routers to forget the stopped worker")


@pytest.mark.slow
def test_without_prewarm_a_worker_added_under_load_takes_its_ring_share_of_new_prefixes_cold(healthy):
    cluster = healthy
    reply = call(cluster.routers[0].url + "/admin/config", "PUT", {"prewarm_top": 0}, headers=ADMIN)
    assert reply.json["shared"] is True
    wait_for(lambda: all(call(r.url + "/admin/config", headers=ADMIN).json["runtime"]["prewarm_top"] == 0
                         for r in cluster.routers), 10, what="both routers to turn pre-warming off")
    try:
        with LoadGenerator(_urls(cluster), concurrency=8, stream_tokens=16, new_prefix_share=0.5) as load:
            wait_for(lambda: len(load.outcomes) >= 80, 60, what="load to make the documents hot")
            cluster.start_worker("w5")
            wait_for(lambda: all("w5" in cluster.routable(r) for r in cluster.routers), 60, interval=0.1,
                     what="both routers to route to the new worker")
            wait_for(lambda: len([o for o in load.outcomes if o.worker == "w5"]) >= 8, 60,
                     what="the new worker to take traffic")
        assert [o for o in load.outcomes if not o.ok] == []
        first = sorted((o for o in load.outcomes if o.worker == "w5"), key=lambda o: o.started)[:8]
        assert [o.cached_tokens < 2048 - 16 for o in first] == [True] * 8  # cold: new documents only
    finally:
        call(cluster.routers[0].url + "/admin/config", "PUT", {"prewarm_top": 8}, headers=ADMIN)
        cluster.workers["w5"].stop()
    wait_for(lambda: all("w5" not in cluster.states(r) for r in cluster.routers), 60,
             what="the routers to forget the stopped worker")
