"""The router's shared state through a real Redis: registry, KV-event stream, snapshots, config.

Workers' side of the contract (registry entries, load reports, KV events) is written here with
the protocol's own messages and key names, exactly as ``worker/server/publisher.py`` writes them; the
cluster tests run real workers publishing for themselves.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import redis

from protocol import KVEvent, LoadReport, RedisKeys, WorkerInfo
from router.routing.prompt import prompt_key
from tests.integration.router_harness import running_router, scripted_workers, wait_until
from tests.support import free_port

DOC = "".join(f"Section {i}. The parties agree to the terms herein. " for i in range(60))
BODY = {"model": "m", "prompt": DOC + " Question: who pays?", "max_tokens": 2}
ADMIN = {"Authorization": "Bearer s3cret"}


def register(client: redis.Redis, keys: RedisKeys, worker_id: str, url: str, ttl_ms: int = 60_000) -> None:
    client.set(keys.worker(worker_id), WorkerInfo(worker_id, url, "m").to_json(), px=ttl_ms)
    client.set(keys.load(worker_id), LoadReport(worker_id, block_size=16).to_json(), px=ttl_ms)
    client.zadd(keys.workers, {worker_id: time.time()})


def publish(client: redis.Redis, keys: RedisKeys, event: KVEvent) -> None:
    client.xadd(keys.kv_events, {"e": event.to_json()}, maxlen=10_000, approximate=True)


def key_of(ctx, body: dict):
    return prompt_key(body, False, ctx.config.chunk_size, ctx.config.ring_key_chunks)


async def test_self_registered_workers_join_and_leave_with_their_registry_entries(redis_server_url, redis_prefix):
    client = redis.Redis.from_url(redis_server_url)
    keys = RedisKeys(redis_prefix)
    async with scripted_workers("w1") as (worker,), \
            running_router("--redis", redis_server_url, "--redis-prefix", redis_prefix,
                           "--registry-interval", "0.1", "--registry-grace", "0") as (ctx, url):
        assert ctx.balancer.routable() == []
        register(client, keys, "w1", worker.url)
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="w1 to join")
        client.delete(keys.worker("w1"))  # its heartbeat expired
        await wait_until(lambda: ctx.registry.get("w1") is None, what="w1 to leave")
        assert ctx.balancer.routable() == []
        assert client.zscore(keys.workers, "w1") is None  # and the router pruned the stale id
    client.close()


async def test_a_worker_whose_registration_vanishes_stays_while_it_answers_and_leaves_once_it_fails(
        redis_server_url, redis_prefix):
    # Redis restarting empty deletes every registration at once: the fleet must not vanish with it.
    client = redis.Redis.from_url(redis_server_url)
    keys = RedisKeys(redis_prefix)
    async with scripted_workers("w1") as (worker,), \
            running_router("--redis", redis_server_url, "--redis-prefix", redis_prefix, "--registry-interval",
                           "0.1", "--registry-grace", "60", "--health-interval", "0.1") as (ctx, url):
        register(client, keys, "w1", worker.url)
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="w1 to join")
        client.delete(keys.worker("w1"), keys.load("w1"))
        w = ctx.registry.get("w1")
        await wait_until(lambda: w.vanished_at is not None, what="the router to notice")
        assert ctx.balancer.routable() == ["w1"]
        await worker.server.close()  # now it stops answering probes as well
        await wait_until(lambda: ctx.registry.get("w1") is None, what="w1 to leave")
    client.close()


async def test_kv_events_from_the_stream_steer_requests_to_the_worker_holding_the_prefix(
        redis_server_url, redis_prefix):
    client = redis.Redis.from_url(redis_server_url)
    keys = RedisKeys(redis_prefix)
    async with scripted_workers("w1", "w2") as workers, \
            running_router("--redis", redis_server_url, "--redis-prefix", redis_prefix,
                           "--tokens-per-byte", "1.0",
                           *[a for w in workers for a in ("--worker", w.url)]) as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 2, what="2 workers")
        key = key_of(ctx, BODY)
        holder = next(w for w in ("w1", "w2") if w != ctx.balancer.ring.owner(key.ring_key))
        publish(client, keys, KVEvent(holder, "stored", key.hashes[:20], seq=0))
        await wait_until(lambda: ctx.balancer.index.match(key.hashes, time.time()) == {holder: 20},
                         what="the stored event")
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert (resp.headers["X-Prefixlb-Worker"], resp.headers["X-Prefixlb-Route-Reason"],
                        resp.headers["X-Prefixlb-Predicted-Cached-Tokens"]) == (holder, "prefix", "2560")
        publish(client, keys, KVEvent(holder, "cleared", [], seq=1))
        await wait_until(lambda: holder not in ctx.balancer.index.match(key.hashes, time.time()),
                         what="the cleared event")
    client.close()


async def test_a_router_started_later_loads_the_snapshot_replays_the_stream_and_routes_warm(
        redis_server_url, redis_prefix):
    client = redis.Redis.from_url(redis_server_url)
    keys = RedisKeys(redis_prefix)
    other = {**BODY, "prompt": "A different document entirely. " * 40}
    async with scripted_workers("w1", "w2") as workers:
        worker_args = [a for w in workers for a in ("--worker", w.url)]
        common = ("--redis", redis_server_url, "--redis-prefix", redis_prefix, *worker_args)
        async with running_router(*common) as (first, url):
            await wait_until(lambda: len(first.balancer.routable()) == 2, what="2 workers")
            key = key_of(first, BODY)
            holder = next(w for w in ("w1", "w2") if w != first.balancer.ring.owner(key.ring_key))
            publish(client, keys, KVEvent(holder, "stored", key.hashes, seq=0))
            await wait_until(lambda: holder in first.balancer.index.match(key.hashes, time.time()),
                             what="the first router to apply the event")
            first.balancer.observe_prompt_tokens("m", 1000, 900)
            assert await first.state.write_snapshot() == len(key.hashes)
        # After the snapshot: one more prefix, only in the stream.
        other_key = key_of(first, other)
        other_holder = next(w for w in ("w1", "w2") if w != first.balancer.ring.owner(other_key.ring_key))
        publish(client, keys, KVEvent(other_holder, "stored", other_key.hashes, seq=1))
        async with running_router(*common) as (late, url):
            # Synchronised before serving: nothing to wait for.
            assert late.state.events_applied == 1  # only the event after the snapshot was replayed
            assert late.balancer.tokens_per_byte("m") == 0.9
            async with aiohttp.ClientSession() as http:
                for body, expected in ((BODY, holder), (other, other_holder)):
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        assert (resp.headers["X-Prefixlb-Worker"], resp.headers["X-Prefixlb-Route-Reason"]) == (
                            expected, "prefix")
    client.close()


async def test_a_config_change_on_one_router_reaches_the_others(redis_server_url, redis_prefix):
    common = ("--redis", redis_server_url, "--redis-prefix", redis_prefix, "--registry-interval", "0.1",
              "--admin-token", "s3cret")
    async with running_router(*common) as (a, url_a), running_router(*common) as (b, _):
        async with aiohttp.ClientSession() as http:
            async with http.put(url_a + "/admin/config", json={"affinity": 0.25}, headers=ADMIN) as resp:
                assert (await resp.json())["shared"] is True
        await wait_until(lambda: b.config.affinity == 0.25, what="router b to adopt the affinity")
        assert b.balancer.config.affinity == 0.25


async def test_a_router_starts_and_serves_from_memory_when_redis_is_unreachable():
    async with scripted_workers("w1") as (worker,), \
            running_router("--redis", f"redis://127.0.0.1:{free_port()}/0", "--startup-sync-timeout", "1",
                           "--worker", worker.url) as (ctx, url):
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="w1")
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
            async with http.get(url + "/health") as resp:
                assert (await resp.json())["redis"] == "down"


async def test_shutdown_ends_even_when_redis_py_swallows_the_cancellation(redis_server_url, redis_prefix):
    # redis-py can swallow the CancelledError of a command cancelled at the wrong moment and
    # return normally (measured: about 1 blocking XREAD in 150); the loop then reads again and a
    # single cancel() left the router's shutdown waiting forever (CI hung on it for 300 s).
    async with running_router("--redis", redis_server_url, "--redis-prefix", redis_prefix) as (ctx, url):
        state = ctx.state
        real_read = state.read_events
        swallowed, entered = [], []

        async def read_events(block_ms):
            entered.append(True)
            try:
                return await real_read(block_ms)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)
                asyncio.current_task().uncancel()
                return 0  # what redis-py did: the command "returned", the cancellation is gone

        state.read_events = read_events
        # The events loop blocks in XREAD for 1 s at a time: wait until it is in one through the wrapper.
        await wait_until(lambda: entered, timeout=10, what="the events loop to read through the wrapper")
    # Leaving the block stopped the router: the first cancellation was swallowed, the second one
    # (or the closing flag) ended the loop.
    assert swallowed == [True]
    assert all(t.done() for t in state._tasks)


async def test_a_drain_asked_of_one_router_drains_the_worker_on_every_router(redis_server_url, redis_prefix):
    argv = ("--redis", redis_server_url, "--redis-prefix", redis_prefix, "--registry-interval", "0.1",
            "--admin-token", "s3cret", "--health-interval", "0.2")
    async with scripted_workers("w1", "w2") as (w1, w2):
        static = ("--worker", w1.url, "--worker", w2.url)
        async with running_router(*argv, *static) as (a, url_a), running_router(*argv, *static) as (b, url_b):
            await wait_until(lambda: sorted(a.balancer.routable()) == sorted(b.balancer.routable()) == ["w1", "w2"],
                             what="both workers on both routers")
            async with aiohttp.ClientSession() as http:
                async with http.post(url_a + "/admin/workers/w1/drain", headers=ADMIN) as resp:
                    body = await resp.json()
                    assert resp.status == 200 and body["shared"] is True
                # Router b drains it too: no new work there (a static worker is then removed when idle).
                await wait_until(lambda: b.balancer.routable() == ["w2"], what="router b to drain w1")
                for _ in range(4):
                    async with http.post(url_b + "/v1/completions", json=BODY) as resp:
                        assert resp.headers["X-Prefixlb-Worker"] == "w2"
                # Adding its URL again through either router ends the drain everywhere.
                async with http.post(url_b + "/admin/workers", json={"url": w1.url}, headers=ADMIN) as resp:
                    assert resp.status == 201 and (await resp.json())["shared"] is True
                await wait_until(lambda: "w1" in b.balancer.routable(), what="w1 back on router b")
    client = redis.Redis.from_url(redis_server_url)
    assert client.hlen(RedisKeys(redis_prefix).drains) == 0
    client.close()


async def _registry_rounds(ctx, n: int) -> None:
    """Wait until the registry loop (drains included) has come round ``n`` more times."""
    rounds = {ctx.state.loop_seen["registry"][0]}

    def came_round() -> bool:
        rounds.add(ctx.state.loop_seen["registry"][0])  # the loop stamps each round as it starts it
        return len(rounds) > n

    await wait_until(came_round, what=f"{n} registry rounds")


async def test_a_shared_drain_names_the_worker_so_a_new_pod_at_its_address_is_not_drained(redis_server_url,
                                                                                         redis_prefix):
    argv = ("--redis", redis_server_url, "--redis-prefix", redis_prefix, "--registry-interval", "0.1",
            "--admin-token", "s3cret", "--health-interval", "0.2")
    async with scripted_workers("w1") as (w1,):
        keys = RedisKeys(redis_prefix)
        client = redis.Redis.from_url(redis_server_url)
        # another router drained the pod that had this address before, under another id
        client.hset(keys.drains, w1.url, json.dumps({"worker_id": "old-pod", "at": 1.0}))
        async with running_router(*argv, "--worker", w1.url) as (a, url_a):
            await wait_until(lambda: a.balancer.routable() == ["w1"], what="w1 routable")
            await _registry_rounds(a, 3)  # the old pod's drain must not take w1 in any of them
            assert a.balancer.routable() == ["w1"]
            # a drain of w1 itself (by id) applies
            client.hset(keys.drains, w1.url, json.dumps({"worker_id": "w1", "at": 2.0}))
            await wait_until(lambda: a.balancer.routable() == [], what="w1 drained by its own drain")
        client.close()


async def test_a_stuck_redis_loop_turns_health_503_and_shows_in_metrics(redis_server_url, redis_prefix, monkeypatch):
    import router.state as state_module

    monkeypatch.setattr(state_module, "STALL_SLACK_S", 0.3)
    argv = ("--redis", redis_server_url, "--redis-prefix", redis_prefix, "--registry-interval", "0.05")
    async with running_router(*argv) as (ctx, url):
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"
            hang = asyncio.Event()

            async def stuck() -> None:  # an await that never returns: not an error, a hang
                await hang.wait()

            ctx.state.sync_drains = stuck  # called by each registry sync
            await wait_until(lambda: ctx.state.stalled() == ["registry"], timeout=5, what="the registry loop stalled")
            async with http.get(url + "/health") as resp:
                body = await resp.json()
                assert resp.status == 503 and body["status"] == "loop_stalled" and body["stalled_loops"] == ["registry"]
            async with http.get(url + "/metrics") as resp:
                assert 'prefixlb_router_loop_age_seconds{task="registry"}' in await resp.text()
            hang.set()
            await wait_until(lambda: ctx.state.stalled() == [], timeout=5, what="the loop coming round again")
