"""HealthChecker: active probes of every known worker, with jitter, feeding the registry.

Each worker gets its own probe loop: ``GET /load`` (a ``protocol.LoadReport``: proof of life,
its id, its load and measured speed) every ``interval`` seconds +- ``jitter``, so that many
routers do not probe a fleet in lockstep. A backend without ``/load`` (an unmodified vLLM or
SGLang server) is probed with ``GET /health`` instead and known by its URL. Models come from
``GET /v1/models`` once, when the worker first answers.

Probe failures and successes feed the worker's breaker (``router/fleet/breaker.py``) through the
registry: consecutive failures open it, and once its cool-down is over the next good probe
half-opens it. A draining worker is marked drained once this router has nothing in flight there.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time

import aiohttp

from protocol import LoadReport, MessageError
from router.fleet.registry import DRAINING, Worker, WorkerRegistry

log = logging.getLogger("prefixlb.router.health")


class ProbeError(Exception):
    """A probe that did not prove the worker alive."""


def refused(exc: BaseException) -> bool:
    """True when ``exc`` is a refused connection: nothing listens at the worker's address."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    return isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)


class HealthChecker:
    """One probe task per worker; started and stopped with the registry's membership."""

    def __init__(self, registry: WorkerRegistry, interval: float, jitter: float, timeout: float,
                 headers: dict[str, str] | None = None) -> None:
        self.registry = registry
        self.headers = headers or {}
        self.interval = interval
        self.jitter = jitter
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[int, asyncio.Task] = {}
        self._rng = random.Random()
        registry.on_added.append(self._start)
        registry.on_removed.append(self._stop)

    async def start(self) -> None:
        """Probe every worker already known once (so the router routes from its first request),
        then keep probing each in the background."""
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        known = self.registry.all()
        await asyncio.gather(*(self.probe(w) for w in known))
        for w in known:
            self._start(w, first_delay=True)

    async def close(self) -> None:
        """Stop every probe loop and close the session."""
        session, self._session = self._session, None  # no new probe loop from here on (see _start)
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if session is not None:
            await session.close()

    async def probe(self, w: Worker) -> None:
        """Probe ``w`` once and report the outcome to the registry."""
        assert self._session is not None
        try:
            report = await self._load(w)
            models = None if w.models else await self._models(w)
        except (ProbeError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.registry.mark_failed(w, f"probe: {type(exc).__name__}: {exc}"[:200], time.time(), refused(exc))
            return
        self.registry.mark_ok(w, time.time(), report=report, models=models)
        if w.state == DRAINING and w.worker_id is not None:
            load = self.registry.balancer.board.get(w.worker_id)
            if load is None or not load.tickets:
                self.registry.drained(w)

    async def _load(self, w: Worker) -> LoadReport | None:
        assert self._session is not None
        async with self._session.get(w.url + "/load") as resp:
            if resp.status == 404:
                async with self._session.get(w.url + "/health") as health:
                    if health.status != 200:
                        raise ProbeError(f"/health answered {health.status}")
                return None
            if resp.status != 200:
                raise ProbeError(f"/load answered {resp.status}")
            try:
                return LoadReport.from_dict(await resp.json(content_type=None))
            except (MessageError, json.JSONDecodeError, ValueError) as exc:
                raise ProbeError(f"/load: {exc}") from exc

    async def _models(self, w: Worker) -> tuple[str, ...] | None:
        assert self._session is not None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
            async with self._session.get(w.url + "/v1/models", headers=self.headers) as resp:
                if resp.status == 200:
                    data = (await resp.json(content_type=None)).get("data", [])
                    return tuple(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
        return None

    def _start(self, w: Worker, first_delay: bool = False) -> None:
        if self._session is None or id(w) in self._tasks:
            return
        self._tasks[id(w)] = asyncio.get_running_loop().create_task(self._loop(w, first_delay),
                                                                    name=f"probe {w.url}")

    def _stop(self, w: Worker) -> None:
        task = self._tasks.pop(id(w), None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _loop(self, w: Worker, first_delay: bool) -> None:
        if first_delay:
            await asyncio.sleep(self._delay())
        while self.registry.get(w.url) is w:
            try:
                await self.probe(w)
            except Exception:  # noqa: BLE001 - a bug in one probe must not end the loop
                log.exception("event=probe_crashed url=%s", w.url)
            await asyncio.sleep(self._delay())
        self._tasks.pop(id(w), None)

    def _delay(self) -> float:
        return self.interval * (1.0 + self._rng.uniform(-self.jitter, self.jitter))
