"""RedisState: the router's shared state in Redis, kept off the request path.

Background tasks, each tolerant of Redis being slow or gone (errors are counted, logged once per
outage, and retried with backoff; routing goes on from memory meanwhile):

* **registry** (every ``registry_interval``): self-registered workers (``{p}workers`` +
  ``{p}worker:{id}``) join the registry, vanished ones leave; their load reports
  (``{p}load:{id}``) go to the load board; the shared runtime config (``{p}config``) is adopted
  when another router changed it;
* **events**: the KV-event stream (``{p}kv_events``) is read with a blocking ``XREAD`` and every
  event is applied to the index (every router applies every event);
* **snapshots** (every ``snapshot_interval`` +- 20%): the index is written to
  ``{p}index_snapshot`` with the stream id it covers.

:meth:`RedisState.start` first synchronises -- snapshot, then the stream from the snapshot's id
to its end, then the registry -- so that a router started late routes warm from its first
request (the server only starts listening after it).

**Outages.** Nothing on the request path waits for Redis: while it is gone the router routes
from its in-memory index and the last load reports, and self-registered workers stay (their
liveness comes from this router's probes; a registration that vanishes only removes a healthy
worker after ``registry_grace`` seconds, so Redis restarting empty does not empty the fleet).
When Redis answers again, :meth:`RedisState.resync` checks that no KV event was missed: if the
stream was trimmed past the last event applied here, the latest snapshot is merged and reading
resumes from its id; if the stream is gone (Redis restarted without persistence) or was
recreated, reading restarts from its beginning and this router writes a snapshot at once, so
that routers starting now find one. A router whose start-up sync failed does the full sync then.
On a clean shutdown the router writes a last snapshot.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from typing import Any, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from protocol import KVEvent, LoadReport, MessageError, RedisKeys, WorkerInfo, untrusted_json
from protocol.redis_url import redis_client
from protocol.signing import ReplayGuard, verify
from router.routing.balancer import Balancer
from router.metrics import RouterMetrics
from router.fleet.registry import REDIS_SOURCE, ROUTABLE, WARMING, InvalidWorkerURL, WorkerRegistry
from router.snapshot import SnapshotError, decode, encode

log = logging.getLogger("prefixlb.router.state")

READ_COUNT = 1000
SNAPSHOT_SLICE = 5000  # index entries copied between two yields to the event loop
BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
STALL_SLACK_S = 30.0  # beyond 3 rounds of its period, a loop not come round in this long is stuck
MAX_CONFIG_VERSION = 2**53  # beyond this a shared config version is not a counter's (poison)
MAX_REGISTERED = 10_000  # self-registered workers read from Redis at most (a registry size cap)
DRAINS_TTL_S = 7 * 24 * 3600  # an admin drain nobody renewed or cancelled for a week is forgotten


class Replayed(Exception):
    """A validly signed message that is not fresh (protocol/signing.py's ReplayGuard)."""


REPLAYED = object()  # what _decode returns for a replayed message


class RedisState:
    """Syncs one router's in-memory state with Redis (see the module docstring)."""

    def __init__(self, url: str, keys: RedisKeys, balancer: Balancer, registry: WorkerRegistry,
                 metrics: RouterMetrics, registry_interval: float = 1.0, snapshot_interval: float = 30.0,
                 apply_config: Callable[[dict[str, str]], None] | None = None,
                 registry_grace: float = 15.0, signing_secret: str | None = None) -> None:
        self.url = url
        self.signing_secret = signing_secret  # protocol/signing.py: only signed worker messages count
        self.replays = ReplayGuard(capacity=4 * MAX_REGISTERED)  # with a secret: only fresh ones count
        self._accepted: dict[str, WorkerInfo] = {}  # the last fresh registration of each worker id
        self.keys = keys
        self.balancer = balancer
        self.registry = registry
        self.metrics = metrics
        self.registry_interval = registry_interval
        self.snapshot_interval = snapshot_interval
        self.apply_config = apply_config
        self.registry_grace = registry_grace
        self.synced = False
        self.last_id = "0-0"
        self.config_version = 0
        self.events_applied = 0
        self._client: aioredis.Redis | None = None
        self._stream_client: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._down: set[str] = set()
        self._registered: set[str] = set()  # worker ids registered in Redis at the last registry sync
        self.loop_seen: dict[str, tuple[float, float]] = {}  # loop -> (last time round, stall limit)
        self._snapshot_now = asyncio.Event()

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self, sync_timeout: float) -> bool:
        """Synchronise from Redis (at most ``sync_timeout`` s), then start the background tasks.

        Returns whether the initial sync completed; without it the router serves from memory
        and the tasks keep trying.
        """
        self.connect()
        try:
            await asyncio.wait_for(self.sync(), timeout=sync_timeout)
            self.synced = True
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.metrics.redis_errors.labels("sync").inc()
            self._down.add("events")
            log.warning("event=redis_sync_failed error=%r serving=from_memory", str(exc)[:200])
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._every(self.registry_interval, self.sync_registry, "registry")),
                       loop.create_task(self._events_loop()),
                       loop.create_task(self._snapshot_loop())]
        return self.synced

    def connect(self) -> None:
        """Create the Redis clients (they connect lazily, and reconnect by themselves)."""
        self._client = redis_client(self.url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self._stream_client = redis_client(self.url, socket_timeout=10.0, socket_connect_timeout=2.0)

    async def close(self, final_snapshot: bool = False) -> None:
        """Stop the tasks (writing a last snapshot first if asked and Redis answers) and disconnect."""
        self._closing = True
        await _cancel_and_wait(self._tasks, timeout=5.0)
        if final_snapshot and self._client is not None and self.synced:
            try:
                entries = await asyncio.wait_for(self.write_snapshot(), timeout=5.0)
                log.info("event=snapshot_written_on_stop entries=%d", entries)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("event=snapshot_on_stop_failed error=%r", str(exc)[:200])
        for client in (self._client, self._stream_client):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()

    def status(self) -> str:
        """``up`` or ``down`` (some task cannot reach Redis)."""
        return "down" if self._down else "up"

    # -- synchronisation --------------------------------------------------------------------
    async def sync(self) -> None:
        """Load the snapshot, read the registry, replay the stream to its end."""
        await self.load_snapshot()
        await self.sync_registry()  # first: the events of registered workers are taken whatever the bound
        while await self.read_events(block_ms=None):
            pass

    async def resync(self) -> str:
        """After an outage: make sure no KV event was missed (see the module docstring).

        Returns what was found: ``full`` (the start-up sync had failed: done now), ``ok`` (the
        stream still holds everything after our last event), ``trimmed`` (it does not: snapshot
        merged), ``stream_lost`` / ``stream_reset`` (Redis lost or recreated the stream).
        """
        assert self._client is not None
        if not self.synced:
            await self.sync()
            self.synced = True
            kind = "full"
        else:
            try:
                info = await self._client.xinfo_stream(self.keys.kv_events)
            except ResponseError as exc:
                if "no such key" not in str(exc).lower():
                    raise
                info = None
            if info is None:
                kind = "stream_lost"
            elif _stream_id(info.get("last-generated-id")) < _stream_id(self.last_id):
                kind = "stream_reset"
            else:
                first = info.get("first-entry")
                first_id = _stream_id(first[0]) if first else None
                if first_id is not None and self.last_id != "0-0" and first_id > _stream_id(self.last_id):
                    kind = "trimmed"
                else:
                    kind = "ok"
            if kind in ("stream_lost", "stream_reset"):
                # Every event from now on is new; what we hold is the best state left: share it.
                self.last_id = "0-0"
                self._snapshot_now.set()
            elif kind == "trimmed":
                before = self.last_id
                await self.load_snapshot()
                if _stream_id(self.last_id) < _stream_id(before):
                    self.last_id = before  # an older snapshot: keep reading from where we were
        self.metrics.resyncs.labels(kind).inc()
        log.info("event=redis_resync kind=%s stream_id=%s", kind, self.last_id)
        return kind

    async def load_snapshot(self) -> bool:
        """Adopt the latest index snapshot, if any; returns whether one was loaded."""
        assert self._client is not None
        data = await self._client.get(self.keys.index_snapshot)
        if not data:
            return False
        try:
            # off the event loop: a snapshot of a large index takes a while to unpack
            snap = await asyncio.to_thread(decode, data)
        except SnapshotError as exc:
            log.warning("event=snapshot_unreadable error=%s", exc)
            return False
        if snap.chunk_size != self.balancer.chunk_size:
            log.warning("event=snapshot_ignored reason=chunk_size snapshot=%d ours=%d",
                        snap.chunk_size, self.balancer.chunk_size)
            return False
        # Entries keep the life they had left when the snapshot was taken, minus its age.
        age = max(0.0, time.time() - snap.taken_at)
        now = time.time()
        loaded = self.balancer.index.load_entries(((h, w, ttl - age) for h, w, ttl in snap.entries), now)
        self.balancer.load_token_ratios(snap.ratios)
        self.last_id = snap.stream_id
        self.metrics.snapshots.labels("load").inc()
        log.info("event=snapshot_loaded entries=%d stream_id=%s age_s=%.1f", loaded, snap.stream_id, age)
        return True

    async def write_snapshot(self) -> int:
        """Write the index to Redis; returns the number of entries written."""
        assert self._client is not None
        now = time.time()
        # Entries read after this id may already reflect later events; replaying those again
        # on load is harmless (events are idempotent), so the copy can be taken in slices,
        # yielding to requests in between instead of stalling them for a whole index.
        stream_id = self.last_id
        index = self.balancer.index
        hashes = index.hash_list()
        entries: list[tuple[int, str, float]] = []
        for start in range(0, len(hashes), SNAPSHOT_SLICE):
            entries.extend(index.entries_for(hashes[start:start + SNAPSHOT_SLICE], now))
            await asyncio.sleep(0)
        data = await asyncio.to_thread(encode, entries, stream_id, now, self.balancer.chunk_size,
                                       self.balancer.token_ratios())
        ttl = max(60, int(self.snapshot_interval * 10))
        await self._client.set(self.keys.index_snapshot, data, ex=ttl)
        self.metrics.snapshots.labels("write").inc()
        return len(entries)

    async def read_events(self, block_ms: int | None) -> int:
        """Apply the next batch of KV events after ``last_id``; returns how many were read."""
        client = self._stream_client if block_ms else self._client
        assert client is not None
        reply = await client.xread({self.keys.kv_events: self.last_id}, count=READ_COUNT, block=block_ms)
        count = 0
        now = time.time()
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                count += 1
                raw = fields.get(b"e") or fields.get("e")
                if raw is None:
                    continue
                try:
                    event = self._message(KVEvent, raw, "kv_event")
                except Replayed as exc:
                    self._dropped("replay", f"message=kv_event id={self.last_id} {exc}")
                    continue
                except (MessageError, UnicodeDecodeError, ValueError) as exc:
                    self._dropped("kv_event", f"id={self.last_id} error={str(exc)[:200]!r}")
                    continue
                if (event.worker_id not in self._registered and not self.registry.knows_id(event.worker_id)
                        and self.balancer.event_sources_full()):
                    # Events of a worker nobody registered, with the per-source state already at
                    # its bound: random ids must not grow the router's memory without limit.
                    self._dropped("kv_event", f"id={self.last_id} unknown worker_id={event.worker_id!r}")
                    continue
                if self.balancer.apply_kv_event(event, now):
                    self.events_applied += 1
                    self.metrics.kv_events.labels(event.kind).inc()
                    self.metrics.kv_event_lag.observe(max(0.0, now - event.ts))
        return count

    async def sync_registry(self) -> None:
        """Self-registered workers join or leave; load reports and shared config are adopted."""
        assert self._client is not None
        client = self._client
        ids = [i.decode() if isinstance(i, bytes) else str(i)
               for i in await client.zrange(self.keys.workers, 0, MAX_REGISTERED - 1)]
        self._registered = set(ids)
        infos: dict[str, WorkerInfo] = {}
        reports: list[LoadReport] = []
        if ids:
            raw_infos = await client.mget([self.keys.worker(i) for i in ids])
            raw_loads = await client.mget([self.keys.load(i) for i in ids])
            for worker_id, raw_info, raw_load in zip(ids, raw_infos, raw_loads):
                # Bound to the key it was read from: an entry naming another worker is refused.
                info = self._decode(WorkerInfo, raw_info, worker_id, "registration") if raw_info else None
                if info is REPLAYED:  # an old registration written over the worker's: keep its last fresh one
                    info = self._accepted.get(worker_id)
                elif info is not None:
                    self._accepted[worker_id] = info
                if info is not None:
                    infos[worker_id] = info
                report = self._decode(LoadReport, raw_load, worker_id, "load_report") if raw_load else None
                if report is not None and report is not REPLAYED:
                    reports.append(report)
            for stale in [i for i in self._accepted if i not in infos]:
                del self._accepted[stale]
            gone = [i for i in ids if i not in infos]
            if gone:
                await client.zrem(self.keys.workers, *gone)
        for worker_id, info in infos.items():
            try:
                w = self.registry.add(info.url, REDIS_SOURCE, worker_id)
            except InvalidWorkerURL:
                log.warning("event=worker_url_refused worker_id=%s url=%r", worker_id, info.url)
                continue
            self.registry.note_info(w, info)
        now = time.time()
        for w in self.registry.all():
            if w.source == REDIS_SOURCE and w.worker_id is not None and w.worker_id not in infos:
                if w.state in ROUTABLE or w.state == WARMING:
                    # Still answering our probes: give it time to register again (Redis restarted?).
                    if w.vanished_at is None:
                        w.vanished_at = now
                    if now - w.vanished_at < self.registry_grace:
                        continue
                self.registry.remove(w.url)
        for report in reports:
            self.balancer.apply_report(report, now)
        await self.sync_drains()
        await self.sync_config()

    def _decode(self, cls: type, raw: Any, worker_id: str, kind: str) -> Any:
        """A registration or load report read under ``worker_id``'s key, or None (dropped, counted)."""
        try:
            message = self._message(cls, raw, kind, again_ok=True)
        except Replayed as exc:
            self._dropped("replay", f"message={kind} key={worker_id!r} {exc}")
            return REPLAYED
        except (MessageError, UnicodeDecodeError, ValueError) as exc:
            self._dropped(kind, f"worker_id={worker_id!r} error={str(exc)[:200]!r}")
            return None
        if message.worker_id != worker_id:
            self._dropped(kind, f"key={worker_id!r} names={message.worker_id!r}")
            return None
        return message

    def _message(self, cls: type, raw: Any, kind: str, again_ok: bool = False) -> Any:
        """Decode one worker message; with a signing secret only a validly signed and fresh one
        (raises MessageError, SignatureError or ValueError; Replayed for an old one of its worker,
        see protocol/signing.py's ReplayGuard; ``again_ok``: a key re-read, not a stream entry)."""
        if self.signing_secret is None:
            return cls.from_json(raw)
        data = verify(raw, self.signing_secret)
        message = cls.from_dict(data)
        why = self.replays.check(kind, message.worker_id, data, again_ok=again_ok)
        if why is not None:
            raise Replayed(f"worker_id={message.worker_id!r} reason={why} inc={data.get('inc')!r} n={data.get('n')!r}")
        return message

    def _dropped(self, kind: str, detail: str) -> None:
        self.metrics.messages_dropped.labels(kind).inc()
        log.warning("event=message_dropped kind=%s %s", kind, detail)

    async def sync_drains(self) -> None:
        """Drain the workers another router drained (admin API); undrain those it undrained.

        A drain names the worker's URL *and* the id it had then: a pod that later gets the same
        address under another id (Kubernetes reuses pod IPs) is not drained by it.
        """
        assert self._client is not None
        drains = {_text(url): _text(value) for url, value in (await self._client.hgetall(self.keys.drains)).items()}
        for w in self.registry.all():
            drained_id = drains.get(w.url)
            if drained_id is not None and _drain_applies(drained_id, w.worker_id):
                if not w.admin_drain:
                    log.info("event=worker_drain_adopted url=%s worker_id=%s", w.url, w.worker_id)
                    self.registry.drain(w.url)
                w.drain_shared = True
            elif w.admin_drain and w.drain_shared:
                log.info("event=worker_undrain_adopted url=%s worker_id=%s", w.url, w.worker_id)
                self.registry.undrain(w)

    async def publish_drain(self, url: str, drained: bool, worker_id: str | None = None) -> None:
        """Share an admin drain (or its end) with every router (raises ``RedisError`` if Redis is gone)."""
        assert self._client is not None
        if drained:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(self.keys.drains, url, json.dumps({"worker_id": worker_id, "at": time.time()}))
                pipe.expire(self.keys.drains, DRAINS_TTL_S)
                await pipe.execute()
        else:
            await self._client.hdel(self.keys.drains, url)

    async def sync_config(self) -> None:
        """Adopt the shared runtime config if another router changed it since we last looked.

        Versions are a Redis counter (``HINCRBY`` in the transaction that writes the values), so
        they name changes without trusting any router's clock; a version that is not a plausible
        counter value (poison) is ignored until the next change resets it.
        """
        assert self._client is not None
        raw = await self._client.hgetall(self.keys.config)
        values = {_text(k): _text(v) for k, v in raw.items()}
        try:
            version = int(values.pop("version", "0"))
        except ValueError:
            return
        # any other version is a newer change: the counter only moves when a router publishes
        # (or starts again after Redis lost it, or after poison was reset)
        if 0 < version <= MAX_CONFIG_VERSION and version != self.config_version and self.apply_config is not None:
            self.config_version = version
            self.apply_config(values)

    async def publish_config(self, values: dict[str, Any]) -> None:
        """Share runtime config with every router (raises ``RedisError`` if Redis is gone)."""
        assert self._client is not None
        mapping = {k: str(v) for k, v in values.items()}
        for _ in range(2):
            try:
                async with self._client.pipeline(transaction=True) as pipe:
                    pipe.hincrby(self.keys.config, "version", 1)
                    pipe.hset(self.keys.config, mapping=mapping)
                    version, _ = await pipe.execute()
                break
            except ResponseError:
                # a version that is no counter (an older router's clock value, or poison): restart it
                await self._client.hset(self.keys.config, "version", "0")
        else:
            raise RedisError("the shared config version cannot be incremented")
        if int(version) > MAX_CONFIG_VERSION:
            await self._client.hset(self.keys.config, "version", "1")
            version = 1
        self.config_version = int(version)

    # -- loops ------------------------------------------------------------------------------
    def stalled(self) -> list[str]:
        """Loops that have not come round for far longer than they should: stuck (a hung await,
        a bug), not merely failing -- a loop that fails still comes round with its backoff."""
        now = time.monotonic()
        return sorted(task for task, (seen, limit) in self.loop_seen.items() if now - seen > limit)

    def _alive(self, task: str, limit_s: float) -> None:
        self.loop_seen[task] = (time.monotonic(), limit_s)

    async def _every(self, interval: float, step: Callable[[], Any], task: str) -> None:
        failures = 0
        while not self._closing:
            self._alive(task, STALL_SLACK_S + 3 * interval)
            try:
                await step()
                self._recovered(task)
                failures = 0
                await asyncio.sleep(interval)
            except (RedisError, OSError) as exc:
                self._failed(task, exc)
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1
            except Exception:  # noqa: BLE001 - one bad message or bug must not end the loop
                self._crashed(task)
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1

    async def _events_loop(self) -> None:
        failures = 0
        while not self._closing:
            self._alive("events", STALL_SLACK_S + 3 * max(BACKOFF_S))
            try:
                if failures or not self.synced:
                    await self.resync()
                await self.read_events(block_ms=1000)
                self._recovered("events")
                failures = 0
            except (RedisError, OSError) as exc:
                self._failed("events", exc)
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1
            except Exception:  # noqa: BLE001 - one bad message or bug must not end the loop
                self._crashed("events")
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1

    async def _snapshot_loop(self) -> None:
        rng = random.Random()
        while not self._closing:
            self._alive("snapshot", STALL_SLACK_S + 3 * self.snapshot_interval)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._snapshot_now.wait(), self.snapshot_interval * rng.uniform(0.8, 1.2))
            self._snapshot_now.clear()
            try:
                await self.write_snapshot()
                self._recovered("snapshot")
            except (RedisError, OSError) as exc:
                self._failed("snapshot", exc)
            except Exception:  # noqa: BLE001 - one bad entry or bug must not end the loop
                self._crashed("snapshot")

    def _failed(self, task: str, exc: BaseException) -> None:
        self.metrics.redis_errors.labels(task).inc()
        if task not in self._down:
            self._down.add(task)
            log.warning("event=redis_unavailable task=%s error=%r", task, str(exc)[:200])

    def _crashed(self, task: str) -> None:
        self.metrics.loop_errors.labels(task).inc()
        log.exception("event=loop_error task=%s (the loop goes on)", task)

    def _recovered(self, task: str) -> None:
        if task in self._down:
            self._down.discard(task)
            log.info("event=redis_recovered task=%s", task)


async def _cancel_and_wait(tasks: list[asyncio.Task], timeout: float) -> None:
    """Cancel ``tasks`` and wait until they end, cancelling again while any still runs.

    One ``cancel()`` is not enough: redis-py can swallow the ``CancelledError`` of a command
    cancelled at the wrong moment (measured: 1 blocking XREAD in 150) and return normally, and a
    loop that then issues its next command would never end (a router's shutdown hung on it).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = {t for t in tasks if not t.done()}
    while pending and loop.time() < deadline:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    if pending:
        log.warning("event=tasks_left_running count=%d", len(pending))
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.error("event=redis_task_failed task=%s error=%r", t.get_name(), t.exception())


def _drain_applies(value: str, worker_id: str | None) -> bool:
    """Whether a shared drain entry (JSON naming the drained worker's id; older routers wrote a
    bare timestamp, which names none) applies to the worker now at that URL."""
    try:
        drained = untrusted_json.loads(value).get("worker_id")
    except (ValueError, AttributeError):
        return True  # an entry of an older router: by URL, as it meant
    # a drain that names a worker waits until the worker at that URL has said who it is
    return drained is None or drained == worker_id


def _stream_id(value: Any) -> tuple[int, int]:
    """A stream entry id (``ms-seq``) as a comparable tuple."""
    ms, _, seq = _text(value).partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
