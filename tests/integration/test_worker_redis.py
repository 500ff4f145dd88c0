"""The worker's side of Redis with real processes and a real Redis: self-registration, heartbeats,
KV events in the router's chunk hashes (stored, and removed exactly on eviction), drain on SIGTERM,
and a Redis outage that never fails a request."""
from __future__ import annotations

import http.client
import json
import shutil
import signal
import subprocess
import threading

import pytest
import redis

from protocol import KVEvent, LoadReport, RedisKeys, WorkerInfo, chunk_hashes, namespace_seed
from tests.integration.worker_client import call
from tests.support import free_port, processes, spawn, wait_for

MODEL = "llama-3-8b"


def _sim_args(port: int, *extra: str) -> list[str]:
    return ["worker", "--simulate", "--time-scale", "1000", "--port", str(port), *extra]


def _events(client: redis.Redis, keys: RedisKeys) -> list[KVEvent]:
    return [KVEvent.from_json(fields[b"e"]) for _, fields in client.xrange(keys.kv_events)]


@pytest.fixture
def rds(redis_server_url):
    client = redis.Redis.from_url(redis_server_url)
    yield client
    client.close()


def test_worker_registers_heartbeats_and_announces_a_cleared_cache(tmp_path, redis_server_url, redis_prefix, rds):
    port = free_port()
    keys = RedisKeys(redis_prefix)
    url = f"http://127.0.0.1:{port}"
    with processes() as procs:
        procs.append(spawn(_sim_args(port, "--redis", redis_server_url, "--redis-prefix", redis_prefix,
                                     "--advertise", url, "--worker-id", "w1", "--heartbeat-interval", "0.2",
                                     "--registry-ttl", "3"), tmp_path, "w1", port=port))
        raw = wait_for(lambda: rds.get(keys.worker("w1")), 10, what="registration")
        info = WorkerInfo.from_json(raw)
        assert (info.url, info.model, info.status, info.simulated, info.chunk_size) == (url, MODEL, "ready", True, 128)
        assert 0 < rds.pttl(keys.worker("w1")) <= 3000
        load = LoadReport.from_json(wait_for(lambda: rds.get(keys.load("w1")), 10, what="load report"))
        assert (load.worker_id, load.status, load.block_size) == ("w1", "ready", 16)
        assert rds.zscore(keys.workers, "w1") is not None
        first = wait_for(lambda: _events(rds, keys), 10, what="first event")[0]
        assert (first.kind, first.seq, first.hashes) == ("cleared", 1, [])
        # Heartbeats keep coming: the load report's timestamp moves on.
        wait_for(lambda: LoadReport.from_json(rds.get(keys.load("w1"))).ts > load.ts, 5, what="next heartbeat")


@pytest.mark.parametrize("engine_args, model", [(["--model", "tiny", "--threads", "1"], "tiny"),
                                                (["--simulate", "--time-scale", "1000"], MODEL)],
                         ids=["tiny-engine", "simulated"])
def test_kv_events_name_the_router_chunks_stored_and_exactly_those_evicted(tmp_path, redis_server_url, redis_prefix,
                                                                           rds, engine_args, model):
    port = free_port()
    keys = RedisKeys(redis_prefix)
    seed = namespace_seed(model)
    first = "".join(chr(97 + i % 26) for i in range(300))  # 301 tokens, chunks end in blocks 8 and 16
    second = "Z" * 600  # 601 tokens: needs every block of a 40-block pool, evicting all of `first`'s
    h_first = chunk_hashes(first.encode(), 128, seed)
    h_second = chunk_hashes(second.encode(), 128, seed)
    assert len(h_first) == 2 and len(h_second) == 4
    with processes() as procs:
        procs.append(spawn(["worker", *engine_args, "--port", str(port), "--redis", redis_server_url,
                            "--redis-prefix", redis_prefix, "--worker-id", "w2", "--kv-blocks", "40"],
                           tmp_path, "w2", port=port, timeout=120))
        url = procs[0].url
        assert call(url + "/v1/completions", "POST", {"model": model, "prompt": first, "max_tokens": 1}).status == 200

        def stored(hashes):
            return lambda: set(hashes) <= {h for e in _events(rds, keys) if e.kind == "stored" for h in e.hashes}
        wait_for(stored(h_first), 10, what="stored events of the first prompt")

        assert call(url + "/v1/completions", "POST", {"model": model, "prompt": second, "max_tokens": 1}).status == 200
        wait_for(stored(h_second), 10, what="stored events of the second prompt")
        events = _events(rds, keys)
        removed = [h for e in events if e.kind == "removed" for h in e.hashes]
        assert sorted(removed) == sorted(h_first)
        stored_all = [h for e in events if e.kind == "stored" for h in e.hashes]
        assert sorted(stored_all) == sorted(h_first + h_second)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))


def _stream_in_background(url: str, body: dict, lines: list[str], started: threading.Event) -> threading.Thread:
    def run():
        host, port = url.split("//")[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for raw in resp:
            line = raw.decode().strip()
            if line:
                lines.append(line)
                started.set()
        conn.close()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_drains_in_flight_requests_then_deregisters(tmp_path, redis_server_url, redis_prefix, rds):
    port = free_port()
    keys = RedisKeys(redis_prefix)
    with processes() as procs:
        # Real-time scale: 150 decode steps of ~7.4 ms keep the request in flight for ~1 s.
        proc = spawn(["worker", "--simulate", "--time-scale", "1", "--port", str(port), "--redis", redis_server_url,
                      "--redis-prefix", redis_prefix, "--worker-id", "w3", "--heartbeat-interval", "0.1"],
                     tmp_path, "w3", port=port)
        procs.append(proc)
        wait_for(lambda: rds.get(keys.worker("w3")), 10, what="registration")
        lines: list[str] = []
        started = threading.Event()
        streamer = _stream_in_background(proc.url, {"model": MODEL, "prompt": "drain me", "max_tokens": 150,
                                                    "ignore_eos": True, "stream": True}, lines, started)
        assert started.wait(10)
        proc.signal(signal.SIGTERM)
        wait_for(lambda: call(proc.url + "/health").status == 503, 5, what="health 503 while draining")
        refused = call(proc.url + "/v1/completions", "POST", {"model": MODEL, "prompt": "late"})
        assert (refused.status, refused.json["error"]["code"]) == (503, "draining")
        assert call(proc.url + "/load").json["status"] == "draining"
        wait_for(lambda: WorkerInfo.from_json(rds.get(keys.worker("w3"))).status == "draining"
                 and LoadReport.from_json(rds.get(keys.load("w3"))).status == "draining", 5,
                 what="draining status in the registry")
        assert streamer.is_alive(), "the request finished before the drain was observed"
        streamer.join(30)
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.popen.wait(15) == 0
        assert rds.get(keys.worker("w3")) is None and rds.get(keys.load("w3")) is None
        assert rds.zscore(keys.workers, "w3") is None
        log = proc.output()
        assert "event=draining" in log and "event=deregistered worker=w3" in log


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_redis_down_never_fails_a_request_and_the_worker_registers_when_it_returns(tmp_path, redis_prefix):
    redis_port = free_port()
    port = free_port()
    keys = RedisKeys(redis_prefix)
    with processes() as procs:
        procs.append(spawn(_sim_args(port, "--redis", f"redis://127.0.0.1:{redis_port}/0", "--redis-prefix",
                                     redis_prefix, "--worker-id", "w4", "--publish-queue", "2"),
                           tmp_path, "w4", port=port))
        url = procs[0].url
        for i in range(4):
            reply = call(url + "/v1/completions", "POST", {"model": MODEL, "prompt": chr(65 + i) * 200, "max_tokens": 2})
            assert reply.status == 200
        metrics = call(url + "/metrics").raw.decode()
        assert "prefixlb_worker_redis_connected 0.0" in metrics
        assert "prefixlb_worker_kv_events_dropped_total 0.0" not in metrics  # the queue of 2 overflowed
        server = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=redis_port)
            wait_for(lambda: client.get(keys.worker("w4")), 20, what="registration after Redis came back")
            # The publisher registers first, flushes the queued events, then marks itself connected.
            wait_for(lambda: "prefixlb_worker_redis_connected 1.0" in call(url + "/metrics").raw.decode(), 10,
                     what="the publisher connected")
            client.close()
        finally:
            server.terminate()
            server.wait(10)


def test_a_redis_password_never_shows_in_the_logs_or_the_admin_api(tmp_path, redis_server_url, redis_prefix, rds):
    # The suite's Redis has no password; its default user takes any one, so the URL still works.
    secret = "s3cret-redis-pw"
    with_password = redis_server_url.replace("redis://", f"redis://default:{secret}@")
    masked = redis_server_url.replace("redis://", "redis://default:***@")
    wport, rport = free_port(), free_port()
    with processes() as procs:
        worker = spawn(_sim_args(wport, "--redis", with_password, "--redis-prefix", redis_prefix, "--worker-id", "w5"),
                       tmp_path, "w5", port=wport)
        procs.append(worker)
        wait_for(lambda: rds.get(RedisKeys(redis_prefix).worker("w5")), 10, what="registration")
        router = spawn(["router", "--port", str(rport), "--redis", with_password, "--redis-prefix", redis_prefix,
                        "--admin-token", "admin-token-for-tests"], tmp_path, "router", port=rport)
        procs.append(router)
        config = call(router.url + "/admin/config", headers={"Authorization": "Bearer admin-token-for-tests"})
        assert config.status == 200 and config.json["settings"]["redis"] == masked
        assert secret not in config.raw.decode()
        wait_for(lambda: "event=redis_connected" in worker.output(), 10, what="the worker's connect log line")
        assert f"url={masked}" in worker.output()
        assert secret not in worker.output() + router.output()
