"""Operations around failures, in-process against scripted workers: drain, pre-warm, and the
router's guards (API keys, worker URL allow-list, slow clients)."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import redis

from protocol import LoadReport, RedisKeys, WorkerInfo
from router.routing.prompt import prompt_key
from tests.integration.router_harness import running_router, scripted_workers, wait_until

ADMIN = {"Authorization": "Bearer s3cret"}


def _doc(name: str) -> str:
    return f"Document {name}. " + "The parties agree to the terms set out below. " * 10


async def test_draining_lets_the_in_flight_stream_finish_then_removes_the_worker():
    async with scripted_workers("w1", "w2") as (w1, w2), \
            running_router("--worker", w1.url, "--worker", w2.url, "--admin-token", "s3cret",
                           "--health-interval", "0.1") as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 2, what="2 workers")
        w1.mode = w2.mode = "gated"
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": _doc("A"), "max_tokens": 2, "stream": True}
            held = await http.post(url + "/v1/completions", json=body, headers={"X-Prefixlb-Affinity": "0"})
            target = held.headers["X-Prefixlb-Worker"]
            await asyncio.wait_for(held.content.readuntil(b"\n\n"), 10)
            async with http.post(url + f"/admin/workers/{target}/drain", headers=ADMIN) as resp:
                assert (await resp.json())["state"] == "draining"
            assert target not in ctx.balancer.routable()
            assert ctx.registry.get(target) is not None  # still there: its stream is in flight
            for w in (w1, w2):
                w.gate.set()
            events = (await held.read()).split(b"\n\n")
            held.release()
        assert events[-2] == b"data: [DONE]"  # the stream finished normally
        await wait_until(lambda: ctx.registry.get(target) is None, what="the drained worker to be removed")


async def test_a_joining_worker_is_sent_the_hottest_prefixes_before_it_takes_traffic():
    async with scripted_workers("w1", "w2") as (w1, w2), \
            running_router("--worker", w1.url, "--admin-token", "s3cret", "--prewarm-top", "2") as (ctx, url):
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="w1")
        async with aiohttp.ClientSession() as http:
            for name, times in (("A", 3), ("B", 2), ("C", 1)):
                for i in range(times):
                    body = {"model": "m", "prompt": _doc(name) + f" question {i}", "max_tokens": 20,
                            "stream": i % 2 == 1}
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
            async with http.post(url + "/admin/workers", json={"url": w2.url}, headers=ADMIN) as resp:
                assert resp.status == 201
            await wait_until(lambda: len(ctx.balancer.routable()) == 2, what="w2 to take traffic")
        # The two hottest prefixes, each as its latest request, for one token, not streamed.
        assert [(b["prompt"], b["max_tokens"], "stream" in b) for b in w2.bodies] == [
            (_doc("A") + " question 2", 1, False), (_doc("B") + " question 1", 1, False)]
        now = time.time()
        for name in ("A", "B"):
            key = prompt_key({"model": "m", "prompt": _doc(name)}, False, ctx.config.chunk_size,
                             ctx.config.ring_key_chunks)
            assert ctx.balancer.index.match(key.hashes, now).get("w2") == len(key.hashes)


async def test_the_admin_api_prewarms_a_worker_on_demand():
    async with scripted_workers("w1", "w2") as (w1, w2), \
            running_router("--worker", w1.url, "--worker", w2.url, "--admin-token", "s3cret",
                           "--prewarm-top", "4") as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 2, what="2 workers")
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": _doc("A"), "max_tokens": 5}
            async with http.post(url + "/v1/completions", json=body, headers={"X-Prefixlb-Affinity": "1"}) as resp:
                owner = resp.headers["X-Prefixlb-Worker"]
            other = w2 if owner == "w1" else w1
            sent_before = len(other.bodies)
            async with http.post(url + f"/admin/workers/{other.worker_id}/prewarm", json={"top": 3},
                                 headers=ADMIN) as resp:
                assert await resp.json() == {"sent": 1, "ok": 1, "worker_id": other.worker_id, "tracked": 1}
            async with http.post(url + "/admin/workers/w1/prewarm", json={"top": 0}, headers=ADMIN) as resp:
                assert resp.status == 400
        assert other.bodies[sent_before:] == [{**body, "max_tokens": 1}]


async def test_with_api_keys_clients_need_one_and_workers_get_the_routers_own():
    async with scripted_workers("w1") as (worker,), \
            running_router("--worker", worker.url, "--api-key", "client-key", "--api-key", "other-key",
                           "--worker-api-key", "worker-key") as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 1, what="w1")
        body = {"model": "m", "prompt": "hello", "max_tokens": 2}
        async with aiohttp.ClientSession() as http:
            for headers, status in (({}, 401), ({"Authorization": "Bearer nope"}, 401),
                                    ({"Authorization": "Bearer other-key"}, 200)):
                async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == status
                async with http.get(url + "/v1/models", headers=headers) as resp:
                    assert resp.status == status
            async with http.get(url + "/health") as resp:
                assert resp.status == 200  # operations endpoints stay open for probes
        assert worker.headers[-1]["Authorization"] == "Bearer worker-key"


async def test_worker_urls_outside_the_allow_list_are_refused_from_the_admin_api_and_from_redis(
        redis_server_url, redis_prefix):
    client = redis.Redis.from_url(redis_server_url)
    keys = RedisKeys(redis_prefix)
    async with scripted_workers("w1") as (worker,), \
            running_router("--admin-token", "s3cret", "--worker-allow", "127.0.0.1", "--redis", redis_server_url,
                           "--redis-prefix", redis_prefix, "--registry-interval", "0.1") as (ctx, url):
        async with aiohttp.ClientSession() as http:
            for target in ("http://169.254.169.254/latest", "http://10.0.0.1:8000", "http://localhost:80"):
                async with http.post(url + "/admin/workers", json={"url": target}, headers=ADMIN) as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"]["code"] == "invalid_url"
        for worker_id, target in (("evil", "http://169.254.169.254:80"), ("w1", worker.url)):
            client.set(keys.worker(worker_id), WorkerInfo(worker_id, target, "m").to_json(), px=60_000)
            client.set(keys.load(worker_id), LoadReport(worker_id).to_json(), px=60_000)
            client.zadd(keys.workers, {worker_id: time.time()})
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="the allowed worker to join")
        assert [w.url for w in ctx.registry.all()] == [worker.url]
    client.close()


async def test_a_client_too_slow_to_send_its_body_gets_a_408_and_the_router_keeps_serving():
    async with scripted_workers("w1") as (worker,), \
            running_router("--worker", worker.url, "--body-timeout", "0.3") as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 1, what="w1")
        host, port = url.split("//")[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")  # ... and the rest never comes
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(head.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as resp:
                assert resp.status == 200
