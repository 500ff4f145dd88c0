"""The worker's RedisPublisher against a real Redis: heartbeats keep the registration alive even
while KV events never stop coming."""
from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlparse

import redis.asyncio as aioredis

from protocol.keys import RedisKeys
from protocol.messages import LoadReport, WorkerInfo
from worker.server.publisher import RedisPublisher


@contextlib.asynccontextmanager
async def delaying_proxy(redis_url: str, delay: float):
    """A TCP proxy in front of Redis whose replies arrive ``delay`` seconds late (a distant Redis)."""
    target = urlparse(redis_url)

    async def pipe(reader, writer, lag):
        try:
            while data := await reader.read(65536):
                if lag:
                    await asyncio.sleep(lag)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    tasks: set[asyncio.Task] = set()

    async def handle(client_r, client_w):
        server_r, server_w = await asyncio.open_connection(target.hostname, target.port)
        for t in (asyncio.create_task(pipe(client_r, server_w, 0)),
                  asyncio.create_task(pipe(server_r, client_w, delay))):
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}{target.path or '/0'}"
    finally:
        server.close()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def steady_events(pub: RedisPublisher, stop: asyncio.Event) -> None:
    """One KV event every 2 ms (a busy worker) until ``stop`` is set."""
    i = 0
    while not stop.is_set():
        i += 1
        pub.publish("stored", [i])
        await asyncio.sleep(0.002)


def _info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, url="http://127.0.0.1:1", model="m", block_size=16, chunk_size=128,
                      capacity_tokens=1024, max_num_seqs=8, status="ready", simulated=True)


async def test_a_steady_stream_of_kv_events_does_not_starve_the_heartbeat(redis_server_url, redis_prefix):
    # Redis 5 ms away and one KV event every 2 ms (a busy worker): the queue is never empty after
    # a flush, yet the registration (TTL 1 s) must be refreshed every heartbeat (0.1 s).
    keys = RedisKeys(redis_prefix)
    async with delaying_proxy(redis_server_url, 0.005) as url:
        pub = RedisPublisher(url, keys, _info("w1"), lambda: LoadReport(worker_id="w1"),
                             heartbeat_interval=0.1, ttl=1.0)
        pub.start()
        stop = asyncio.Event()
        producer = asyncio.create_task(steady_events(pub, stop))
        try:
            await asyncio.sleep(2.0)
            assert pub.stats.published > 0
            assert pub.stats.heartbeats >= 5, pub.stats
            rds = aioredis.Redis.from_url(redis_server_url)
            try:
                assert await rds.exists(keys.worker("w1")), "the registration expired"
                report = LoadReport.from_json(await rds.get(keys.load("w1")))
                assert time.time() - report.ts < 0.5
            finally:
                await rds.aclose()
        finally:
            stop.set()
            await producer
            await pub.stop()


async def test_stop_ends_even_when_redis_py_swallows_the_cancellation(redis_server_url, redis_prefix, monkeypatch):
    # drain_and_stop stops the publisher while in-flight requests still produce KV events. The
    # flush outlasts flush_timeout, stop() cancels the task, and redis-py can swallow that
    # CancelledError (about 1 command in 150) and return normally: one cancel() then left stop()
    # flushing a queue that never empties for as long as the requests ran.
    from redis.asyncio.client import Pipeline

    real_execute = Pipeline.execute
    swallowed = []

    async def execute(self, *args, **kwargs):
        try:
            return await real_execute(self, *args, **kwargs)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)
            asyncio.current_task().uncancel()
            return []  # what redis-py did: the command "returned", the cancellation is gone

    monkeypatch.setattr(Pipeline, "execute", execute)
    keys = RedisKeys(redis_prefix)
    async with delaying_proxy(redis_server_url, 0.005) as url:
        pub = RedisPublisher(url, keys, _info("w2"), lambda: LoadReport(worker_id="w2"), heartbeat_interval=0.1)
        pub.start()
        stop = asyncio.Event()
        producer = asyncio.create_task(steady_events(pub, stop))
        try:
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await asyncio.wait_for(pub.stop(flush_timeout=0.5), 5.0)
            assert time.monotonic() - started < 2.0
            assert swallowed == [True]
            assert pub._task.done()
        finally:
            stop.set()
            await producer
            if not pub._task.done():
                pub._task.cancel()


async def test_a_failing_load_report_does_not_stop_the_heartbeats_for_good(redis_server_url, redis_prefix):
    # Anything but a Redis error used to end the publisher's task silently: no more heartbeats, and
    # every router dropped a healthy worker when its registration expired.
    keys = RedisKeys(redis_prefix)
    calls = []

    def load() -> LoadReport:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a bug in one load report")
        return LoadReport(worker_id="w3")

    pub = RedisPublisher(redis_server_url, keys, _info("w3"), load, heartbeat_interval=0.05, max_backoff=0.1)
    pub.start()
    try:
        deadline = time.monotonic() + 5.0
        while pub.stats.heartbeats < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert pub.stats.heartbeats >= 4 and pub.stats.failures == 1, pub.stats
        assert not pub._task.done()
    finally:
        await pub.stop()
