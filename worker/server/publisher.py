"""The worker's side of Redis: registration, load heartbeats and the KV-event stream.

Nothing here is on a request's path. Handlers call :meth:`RedisPublisher.publish` (O(1), no
I/O) and return; one background task owns the connection and does all the writing::

    every heartbeat_interval:  SET {p}worker:{id} WorkerInfo EX ttl
                               SET {p}load:{id}   LoadReport EX ttl
                               ZADD {p}workers {id: now}
    whenever events wait:      XADD {p}kv_events MAXLEN ~ N  e=<KVEvent JSON>   (pipelined)
    on stop:                   flush what is queued, then DEL worker/load, ZREM workers

If Redis is slow or down, events wait in a bounded queue; when it is full the *oldest* are
dropped and counted (``kv_events_dropped``; the router sees the gap in ``seq``). The task
reconnects with exponential backoff and jitter, and re-registers as soon as Redis is back.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from protocol.keys import RedisKeys
from protocol.messages import MEDIUM_GPU, KVEvent, LoadReport, WorkerInfo
from protocol.redis_url import redis_client
from protocol.signing import Incarnation, sign
from protocol.settings import redact_url

INCARNATION = Incarnation()  # this worker process's, drawn once when it starts

log = logging.getLogger("prefixlb.worker.publisher")

BATCH = 256


@dataclass(slots=True)
class PublisherStats:
    """Counters a server exposes in /metrics."""

    published: int = 0
    dropped: int = 0
    failures: int = 0
    heartbeats: int = 0
    connected: bool = False
    last_error: str | None = None  # the latest failure to reach Redis (for /health)


class RedisPublisher:
    """Keeps this worker registered and its KV events flowing to Redis, off the request path.

    ``info`` is the registry entry (its ``status`` follows :meth:`set_status`); ``load`` is
    called once per heartbeat for a fresh :class:`LoadReport`.
    """

    def __init__(self, url: str, keys: RedisKeys, info: WorkerInfo, load: Callable[[], LoadReport],
                 heartbeat_interval: float = 0.5, ttl: float = 5.0, stream_maxlen: int = 100_000,
                 queue_size: int = 10_000, max_backoff: float = 5.0, signing_key: str | None = None) -> None:
        self.url = url
        self.signing_key = signing_key  # protocol/signing.py: this worker's key, when the fleet signs
        self.keys = keys
        self.info = info
        self.load = load
        self.heartbeat_interval = heartbeat_interval
        self.ttl_ms = max(1000, int(ttl * 1000))
        self.stream_maxlen = stream_maxlen
        self.queue_size = queue_size
        self.max_backoff = max_backoff
        self.stats = PublisherStats()
        self._queue: deque[KVEvent] = deque()
        self._seq = 0
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._client: aioredis.Redis | None = None

    # ------------------------------------------------------------------ request side (no I/O)

    def publish(self, kind: str, hashes: list[int], lora_name: str | None = None, medium: str = MEDIUM_GPU) -> None:
        """Queue one KV event (``lora_name``: whose KV a ``stored`` is; ``medium``: which tier);
        drops the oldest queued event if the queue is full."""
        self._seq += 1
        event = KVEvent(worker_id=self.info.worker_id, kind=kind, hashes=list(hashes),
                        chunk_size=self.info.chunk_size, seq=self._seq, lora_name=lora_name, medium=medium)
        if len(self._queue) >= self.queue_size:
            self._queue.popleft()
            self.stats.dropped += 1
        self._queue.append(event)
        self._wake.set()

    def set_status(self, status: str) -> None:
        """Change the registered status (``ready`` / ``draining``); sent with the next heartbeat."""
        self.info.status = status
        self._wake.set()

    @property
    def pending(self) -> int:
        """Events queued and not yet written."""
        return len(self._queue)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-publisher")

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Flush queued events (bounded by ``flush_timeout``), deregister, close the connection."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), flush_timeout)
            except asyncio.TimeoutError:
                # Cancel until it ends: redis-py can swallow the CancelledError of a command and
                # return normally, and the flush goes on while in-flight requests add events.
                while not self._task.done():
                    self._task.cancel()
                    await asyncio.wait({self._task}, timeout=0.1)
        try:
            client = await self._connect()
            await asyncio.wait_for(self._deregister(client), flush_timeout)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("event=deregister_failed worker=%s error=%r", self.info.worker_id, exc)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ background task

    def _text(self, message: WorkerInfo | LoadReport | KVEvent) -> str:
        """The message as written to Redis: signed with this worker's key when it has one."""
        if not self.signing_key:
            return message.to_json()
        # the process's incarnation and the next number, signed: routers drop replays (protocol/signing.py)
        return sign(INCARNATION.stamp(message.to_dict()), self.signing_key)

    async def _connect(self) -> aioredis.Redis:
        if self._client is None:
            self._client = redis_client(self.url, socket_connect_timeout=1.0, socket_timeout=2.0,
                                        retry_on_timeout=False)
        return self._client

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except (RedisError, OSError):
                pass

    async def _run(self) -> None:
        backoff = 0.1
        next_heartbeat = 0.0
        while True:
            try:
                client = await self._connect()
                now = time.monotonic()
                if now >= next_heartbeat or self._stopping:
                    await self._heartbeat(client)
                    next_heartbeat = now + self.heartbeat_interval
                while self._queue:
                    await self._flush(client)
                    if not self._stopping and time.monotonic() >= next_heartbeat:
                        break  # events that never stop coming must not starve the heartbeat
                if not self.stats.connected:
                    log.info("event=redis_connected worker=%s url=%s", self.info.worker_id, redact_url(self.url))
                self.stats.connected = True
                self.stats.last_error = None
                backoff = 0.1
                if self._stopping:
                    return
                self._wake.clear()
                timeout = max(0.0, next_heartbeat - time.monotonic())
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive any one failure
                self.stats.failures += 1
                if not isinstance(exc, (RedisError, OSError)):
                    # A bug (in a load report, a message, redis-py): logged loudly, retried, since a
                    # dead publisher would silently take a healthy worker out of every registry.
                    log.exception("event=publisher_step_failed worker=%s", self.info.worker_id)
                elif self.stats.connected:
                    log.warning("event=redis_lost worker=%s error=%r", self.info.worker_id, exc)
                elif self.stats.failures == 1 and not self.stats.heartbeats:
                    log.warning("event=redis_unreachable worker=%s url=%s error=%r: not registered (routers "
                                "reading Redis do not see this worker) until Redis answers; retrying",
                                self.info.worker_id, redact_url(self.url), exc)
                self.stats.last_error = repr(exc)
                self.stats.connected = False
                await self._drop_client()
                if self._stopping:
                    return
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(self.max_backoff, backoff * 2)

    async def _heartbeat(self, client: aioredis.Redis) -> None:
        report = self.load()
        report.status = self.info.status
        wid = self.info.worker_id
        pipe = client.pipeline(transaction=False)
        pipe.set(self.keys.worker(wid), self._text(self.info), px=self.ttl_ms)
        pipe.set(self.keys.load(wid), self._text(report), px=self.ttl_ms)
        pipe.zadd(self.keys.workers, {wid: time.time()})
        await pipe.execute()
        self.stats.heartbeats += 1

    async def _flush(self, client: aioredis.Redis) -> None:
        batch = [self._queue[i] for i in range(min(BATCH, len(self._queue)))]
        pipe = client.pipeline(transaction=False)
        for event in batch:
            pipe.xadd(self.keys.kv_events, {"e": self._text(event)}, maxlen=self.stream_maxlen,
                      approximate=True)
        await pipe.execute()
        last = batch[-1].seq
        # Events dropped while the pipeline ran may have shifted the queue: remove by seq.
        while self._queue and self._queue[0].seq <= last:
            self._queue.popleft()
        self.stats.published += len(batch)

    async def _deregister(self, client: aioredis.Redis) -> None:
        wid = self.info.worker_id
        pipe = client.pipeline(transaction=False)
        pipe.delete(self.keys.worker(wid), self.keys.load(wid))
        pipe.zrem(self.keys.workers, wid)
        await pipe.execute()
        log.info("event=deregistered worker=%s", wid)
