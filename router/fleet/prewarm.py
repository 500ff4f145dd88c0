"""Pre-warming: replay the hottest prefixes to a joining worker before it takes traffic.

A new worker starts with an empty cache. Consistent hashing hands it its share of *new*
prefixes, but the hot ones it takes over (its ring share) or receives as spill-over all miss
once -- a burst of cold prefills right when the fleet needed more capacity. With
``--prewarm-top K`` the router keeps the most requested prefixes (:class:`HotPrefixes`: decayed
request counts per ring key, each with its latest request body as a sample) and, when a worker
joins after start-up, sends it the K hottest with ``max_tokens=1`` (:class:`Prewarmer`) before
putting it on the ring. The seeds recommend it for bursty traffic, where gaps between bursts
let caches go cold; under steady traffic real requests warm caches anyway.

The samples are bounded: ``capacity`` keys (4 x K, at least 32), bodies up to
``max_body_bytes`` each (larger ones are counted, never kept).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import aiohttp

from protocol import RenderError
from router.routing.prompt import prompt_key

if TYPE_CHECKING:
    from router.routing.balancer import Balancer
    from router.metrics import RouterMetrics
    from router.fleet.connections import WorkerConnections
    from router.fleet.registry import Worker

log = logging.getLogger("prefixlb.router.prewarm")

CONCURRENCY = 4
DROPPED_FIELDS = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs",
                  "max_completion_tokens")


@dataclass(slots=True)
class HotPrefix:
    """One tracked prefix: its decayed request count (plus what it inherited) and a sample."""

    key: int
    score: float  # own requests + inherited count, decayed to ``at``
    inherited: float  # the count it took over from the entry it replaced, decayed to ``at``
    at: float
    path: str
    model: str
    body: bytes | None

    def decay(self, now: float, half_life_s: float) -> float:
        """The factor counts recorded at ``at`` have decayed by at ``now``."""
        return 0.5 ** (max(0.0, now - self.at) / half_life_s)

    def value(self, now: float, half_life_s: float) -> float:
        """The decayed count at ``now`` (an upper bound of its own requests)."""
        return self.score * self.decay(now, half_life_s)

    def hits(self, now: float, half_life_s: float) -> float:
        """Its own decayed requests at ``now`` (a lower bound: the inherited part excluded)."""
        return (self.score - self.inherited) * self.decay(now, half_life_s)


class HotPrefixes:
    """The most requested prefixes, by decayed count. Space-Saving: a new key replaces the
    coldest entry and inherits its count (so a prefix requested more often than 1 in
    ``capacity`` is never crowded out by one-offs), but ranks by its own requests only (so a
    one-off never looks hot). No I/O."""

    def __init__(self, capacity: int, max_body_bytes: int, half_life_s: float = 300.0) -> None:
        self.capacity = max(1, capacity)
        self.max_body_bytes = max_body_bytes
        self.half_life_s = half_life_s
        self._items: dict[int, HotPrefix] = {}

    def __len__(self) -> int:
        return len(self._items)

    def record(self, key: int, path: str, model: str, body: bytes, now: float) -> None:
        """Count one request of prefix ``key`` (its body becomes the sample if small enough)."""
        sample = body if len(body) <= self.max_body_bytes else None
        item = self._items.get(key)
        if item is None:
            inherited = 0.0
            if len(self._items) >= self.capacity:
                coldest = min(self._items.values(), key=lambda i: i.value(now, self.half_life_s))
                inherited = coldest.value(now, self.half_life_s)
                del self._items[coldest.key]
            self._items[key] = HotPrefix(key, inherited + 1.0, inherited, now, path, model, sample)
            return
        factor = item.decay(now, self.half_life_s)
        item.score = item.score * factor + 1.0
        item.inherited *= factor
        item.at = now
        item.path, item.model = path, model
        if sample is not None:
            item.body = sample

    def top(self, k: int, now: float, models: tuple[str, ...] = ()) -> list[HotPrefix]:
        """The ``k`` hottest prefixes with a sample (only for ``models``, when given)."""
        usable = [i for i in self._items.values() if i.body is not None and (not models or i.model in models)]
        usable.sort(key=lambda i: (-i.hits(now, self.half_life_s), i.key))
        return usable[:k]


def warm_body(sample: bytes) -> bytes:
    """``sample`` turned into a one-token, non-streaming request (same prompt, same namespace)."""
    body: dict[str, Any] = json.loads(sample)
    for name in DROPPED_FIELDS:
        body.pop(name, None)
    body["max_tokens"] = 1
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class Prewarmer:
    """Sends a joining worker the hottest prefixes, then lets it take traffic.

    It is the registry's ``warmup`` hook (:meth:`wants`) and sends through the router's pooled
    ``connections``; it warms nobody before :meth:`start` (the fleet known at start-up joins
    directly) or after :meth:`close`.
    """

    def __init__(self, hot: HotPrefixes, top: int, timeout_s: float, connections: "WorkerConnections",
                 balancer: "Balancer", metrics: "RouterMetrics", chunk_size: int, ring_key_chunks: int,
                 headers: dict[str, str] | None = None) -> None:
        self.hot = hot
        self.top = top
        self.timeout_s = timeout_s
        self.connections = connections
        self.balancer = balancer
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.ring_key_chunks = ring_key_chunks
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.enabled = False
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        """Warm every worker that joins from now on (the connections are open)."""
        self.enabled = True

    def set_top(self, top: int) -> None:
        """Change K at run time (0 turns pre-warming, and the tracking of hot prefixes, off)."""
        self.top = top
        self.hot.capacity = max(self.hot.capacity, 4 * top)

    def wants(self, w: "Worker", warmed: Callable[["Worker"], None]) -> bool:
        """Registry hook for a worker that just passed its first probe: True if it is pre-warmed
        first (this schedules it, and calls ``warmed(w)`` when done, whatever the outcome)."""
        if not self.enabled or self.top <= 0:
            return False
        if not self.hot.top(1, time.time(), w.models):
            return False
        task = asyncio.get_running_loop().create_task(self._warm_then_route(w, warmed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def close(self) -> None:
        """Cancel pre-warming in progress (and start none from now on)."""
        self.enabled = False
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass

    async def _warm_then_route(self, w: "Worker", warmed: Callable[["Worker"], None]) -> None:
        try:
            await asyncio.wait_for(self.warm(w, self.top), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("event=prewarm_timeout worker=%s timeout_s=%s", w.worker_id, self.timeout_s)
        finally:
            warmed(w)

    async def warm(self, w: "Worker", k: int) -> dict[str, int]:
        """Send ``w`` the ``k`` hottest prefixes (``max_tokens=1``); returns ``{"sent", "ok"}``."""
        items = self.hot.top(k, time.time(), w.models)
        semaphore = asyncio.Semaphore(CONCURRENCY)
        started = time.perf_counter()

        async def one(item) -> bool:
            async with semaphore:
                return await self._send(w, item)

        results = await asyncio.gather(*(one(i) for i in items))
        ok = sum(results)
        log.info("event=prewarmed worker=%s sent=%d ok=%d seconds=%.3f", w.worker_id, len(items), ok,
                 time.perf_counter() - started)
        return {"sent": len(items), "ok": ok}

    async def _send(self, w: "Worker", item: HotPrefix) -> bool:
        assert item.body is not None
        try:
            body = warm_body(item.body)
            key = prompt_key(json.loads(body), item.path.endswith("/chat/completions"), self.chunk_size,
                             self.ring_key_chunks)
        except (ValueError, RenderError):
            self.metrics.prewarm.labels("invalid").inc()
            return False
        try:
            async with self.connections.session.post(w.url + item.path, data=body, headers=self.headers) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        self.metrics.prewarm.labels("ok" if ok else "failed").inc()
        if ok and w.worker_id is not None and w.worker_id in self.balancer.board:
            # The worker holds the prefix now: tell the index before its KV events arrive.
            self.balancer.index.insert(key.hashes, w.worker_id, time.time(), confirmed=False)
        return ok
