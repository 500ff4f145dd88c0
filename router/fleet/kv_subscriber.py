"""KVEventSubscriber: the router reads vLLM's ZMQ KV events itself, one SUB socket per backend.

vLLM (``--kv-events-config``, publisher ``zmq``) publishes every batch of ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` events on a PUB socket, numbered from 0, and keeps the
last batches on a replay socket (docs/real-engines.md). Every router subscribes to every
vLLM backend it routes (PUB/SUB fans out; no Redis hop, so each router's copy is exact on its
own) and feeds the :class:`~router.routing.precise.PreciseIndex` of its balancer:

* on start, and whenever the stream is not synchronised (joined late, a gap, a publisher that
  started again), it asks the replay socket for the history from seq 0 and rebuilds the
  backend from it -- batches arriving on the live socket meanwhile wait in the socket and are
  applied after, duplicates skipped by their sequence number;
* a backend whose replay no longer starts at 0 stays *unsynchronised*: it is routed on the
  byte-level index and ``cached_tokens`` feedback, never on entries that may be stale;
* a batch whose sequence number went back while its engine timestamp went forward is a new
  publisher (a restarted engine whose first batches the subscription missed): the backend is
  dropped and resynchronised;
* a malformed message is dropped and counted; the loop never ends because of one.

The health prober (registry) resets a backend the moment it fails, so a killed engine's blocks
never outlive it here either.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from router.fleet.background import cancel_and_wait
from router.routing.precise import PreciseIndex
from router.routing.token_index import Applied, SyncState
from router.routing.vllm_kv_events import KVEventBatch, KVEventDecodeError, decode_frames, replay_request

log = logging.getLogger("prefixlb.router.kv_events")

DEFAULT_TOPIC = "kv"
REPLAY_TIMEOUT_S = 5.0
RESYNC_INTERVAL_S = 2.0  # at most one replay per backend this often
MAX_RESYNC_INTERVAL_S = 60.0  # backing off to this while replays cannot synchronise it
MAX_MESSAGE_BYTES = 64 << 20  # a larger ZMQ message is refused by the socket itself


@dataclass(slots=True)
class SubscriberStats:
    """Counters the metrics endpoint exposes, per backend."""

    batches: int = 0
    malformed: int = 0
    gaps: int = 0
    restarts: int = 0
    resyncs: int = 0
    resync_failures: int = 0


class KVEventSubscriber:
    """One task per subscribed backend; ``add`` / ``remove`` follow the registry."""

    def __init__(self, precise: PreciseIndex, topic: str = DEFAULT_TOPIC,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.precise = precise
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self._context: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self.stats: dict[str, SubscriberStats] = {}
        self._last_ts: dict[str, float] = {}  # newest engine timestamp applied, per backend

    def add(self, backend: str, endpoint: str, replay: str | None) -> None:
        """Subscribe to ``backend``'s publisher at ``endpoint`` (idempotent)."""
        if backend in self._tasks:
            return
        if self._context is None:
            self._context = zmq.asyncio.Context()
        self.precise.track(backend)
        self.stats.setdefault(backend, SubscriberStats())
        self._tasks[backend] = asyncio.get_running_loop().create_task(
            self._run(backend, endpoint, replay), name=f"kv-events {backend}")
        log.info("event=kv_events_subscribed backend=%s endpoint=%s replay=%s", backend, endpoint, replay)

    def remove(self, backend: str) -> None:
        """Stop reading ``backend``'s events and forget its blocks."""
        task = self._tasks.pop(backend, None)
        if task is not None:
            task.cancel()
        self.precise.untrack(backend)
        self.stats.pop(backend, None)
        self._last_ts.pop(backend, None)

    async def close(self) -> None:
        """Cancel every subscription and close the sockets."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_and_wait(tasks)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    # -- the loop ------------------------------------------------------------------------------
    async def _run(self, backend: str, endpoint: str, replay: str | None) -> None:
        assert self._context is not None
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(endpoint)
        stats = self.stats[backend]
        self._last_ts.pop(backend, None)
        interval = RESYNC_INTERVAL_S
        next_resync = time.monotonic() if replay else float("inf")
        try:
            while True:
                if replay and self.precise.index.state(backend) is not SyncState.SYNCHRONISED:
                    wait = next_resync - time.monotonic()
                    if wait <= 0:
                        ok = await self._resync(backend, replay, stats)
                        # a replay that cannot help (its buffer no longer starts at 0) is retried
                        # less and less often: each one moves up to the whole buffer
                        interval = RESYNC_INTERVAL_S if ok else min(MAX_RESYNC_INTERVAL_S, interval * 2)
                        next_resync = time.monotonic() + interval
                        continue
                    try:
                        frames = await asyncio.wait_for(sock.recv_multipart(), wait)
                    except TimeoutError:
                        continue
                else:
                    frames = await sock.recv_multipart()
                self._apply(backend, frames, stats)
        except Exception:  # noqa: BLE001 - a bug here must not take the router down; the backend falls back
            log.exception("event=kv_events_crashed backend=%s", backend)
            self.precise.reset(backend)
        finally:
            sock.close(linger=0)

    def _apply(self, backend: str, frames: list[bytes], stats: SubscriberStats) -> None:
        """Decode one live message and apply it (see the module docstring for the cases)."""
        try:
            topic, batch = decode_frames(frames)
        except KVEventDecodeError as exc:
            stats.malformed += 1
            log.debug("event=kv_event_malformed backend=%s error=%r", backend, str(exc)[:200])
            return
        if batch is None or topic != self.topic:
            return
        stats.batches += 1
        outcome = self.precise.index.apply(backend, batch)
        last_ts = self._last_ts.get(backend)
        if outcome is Applied.DUPLICATE and last_ts is not None and batch.ts > last_ts:
            # Lower seq, later engine time: a new publisher whose first batches we missed.
            stats.restarts += 1
            self.precise.reset(backend)
            self.precise.index.apply(backend, batch)
        elif outcome is Applied.GAP:
            stats.gaps += 1
        elif outcome is Applied.RESTARTED:
            stats.restarts += 1
        if last_ts is None or batch.ts > last_ts:
            self._last_ts[backend] = batch.ts

    async def _resync(self, backend: str, replay: str, stats: SubscriberStats) -> bool:
        """Rebuild ``backend`` from its replay socket's history (from seq 0); True if it worked."""
        history = await self.replay(replay)
        if history is not None and self.precise.index.resynchronise(backend, history):
            stats.resyncs += 1
            if history:
                self._last_ts[backend] = max(self._last_ts.get(backend, history[-1].ts), history[-1].ts)
            log.info("event=kv_events_synchronised backend=%s batches=%d", backend, len(history))
            return True
        stats.resync_failures += 1
        if self.precise.index.state(backend) is SyncState.UNKNOWN:
            self.precise.index.mark_unsynchronised(backend)
        log.info("event=kv_events_unsynchronised backend=%s reason=%s", backend,
                 "replay unreachable" if history is None else "replay does not start at seq 0")
        return False

    async def replay(self, endpoint: str, start_seq: int = 0) -> list[KVEventBatch] | None:
        """Every batch the replay socket at ``endpoint`` still holds from ``start_seq`` on; None
        when it does not answer in time or answers garbage."""
        assert self._context is not None
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(endpoint)
        batches: list[KVEventBatch] = []
        try:
            async with asyncio.timeout(self.replay_timeout_s):
                await sock.send_multipart(replay_request(start_seq))
                while True:
                    frames = await sock.recv_multipart()
                    _, batch = decode_frames(frames[1:])
                    if batch is None:
                        return batches
                    batches.append(batch)
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError) as exc:
            log.debug("event=kv_replay_failed endpoint=%s error=%r", endpoint, str(exc)[:200])
            return None
        finally:
            sock.close(linger=0)
