"""HealthChecker: active probes of every known worker, with jitter, feeding the registry.

Each worker gets its own probe loop, every ``interval`` seconds +- ``jitter`` so that many
routers do not probe a fleet in lockstep. How a worker is probed depends on its kind
(``router/fleet/backends.py``), configured or detected at its first probe:

* ``prefixlb``: ``GET /load``, a ``protocol.LoadReport`` (proof of life, its id, load and speed);
* ``vllm`` / ``sglang``: ``GET /health``, then ``GET /metrics`` turned into the same LoadReport
  (``router/fleet/engine_metrics.py``; speeds need two scrapes). A server whose metrics cannot
  be read stays routable on this router's own in-flight books, and says so (a warning, and its
  ``load_source`` in the admin API and ``/metrics``);
* ``openai`` (any other OpenAI-compatible server): ``GET /health``; load from the router's books.

Engines name no worker id: they are known by their URL's ``host:port``. Models come from
``GET /v1/models`` once, when the worker first answers, with ``max_model_len`` where it says.

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

from protocol import LoadReport, MessageError, untrusted_json
from router.fleet.background import cancel_and_wait
from router.fleet.backends import ENGINE_KINDS, OPENAI, PREFIXLB
from router.fleet.engine_metrics import (EngineMetricsError, EngineScrape, detect_kind, load_report,
                                         mean_prompt_tokens, parse_engine_metrics)
from router.fleet.registry import DRAINING, Worker, WorkerRegistry, worker_id_of

log = logging.getLogger("prefixlb.router.health")

MAX_LOAD_BYTES = 1 << 20  # a /load or /v1/models answer larger than this is not read whole
MAX_METRICS_BYTES = 4 << 20  # a /metrics text larger than this is not parsed
ROUTER_METRIC = "prefixlb_router_requests_total"  # in a router's /metrics: never a worker


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
        self._scrapes: dict[int, tuple[EngineScrape, float]] = {}  # per engine worker: last scrape, mean prompt
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
        await cancel_and_wait(tasks)
        if session is not None:
            await session.close()

    async def probe(self, w: Worker) -> None:
        """Probe ``w`` once, the way its kind needs, and report the outcome to the registry."""
        assert self._session is not None
        try:
            kind = w.backend_kind or await self._detect(w)
            if kind == PREFIXLB:
                report = await self._load(w)
            else:
                await self._health(w)
                report = await self._engine_load(w, kind) if kind in ENGINE_KINDS else None
            models = None if w.models else await self._models(w)
        except (ProbeError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            w.detected_kind = None  # whatever answers there next is detected again
            self._scrapes.pop(id(w), None)
            self.registry.mark_failed(w, f"probe: {type(exc).__name__}: {exc}"[:200], time.time(), refused(exc))
            return
        w.detected_kind = kind if not w.kind else None
        self._note_load_source(w, kind, report)
        self.registry.mark_ok(w, time.time(), report=report, models=models)
        if w.state == DRAINING and w.worker_id is not None:
            load = self.registry.balancer.board.get(w.worker_id)
            if load is None or not load.tickets:
                self.registry.drained(w)

    async def _detect(self, w: Worker) -> str:
        """What ``w`` is (see router/fleet/backends.py): a prefixlb worker answers ``/load`` with a
        LoadReport; a vLLM or SGLang server says so in its ``/metrics``; anything else that answers
        ``/health`` is a plain OpenAI-compatible server."""
        assert self._session is not None
        async with self._session.get(w.url + "/load", headers=self.headers) as resp:
            if resp.status == 200:
                with contextlib.suppress(MessageError, ValueError, aiohttp.ClientError):
                    LoadReport.from_dict(untrusted_json.loads(await resp.content.read(MAX_LOAD_BYTES)))
                    return PREFIXLB
        text = None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError, OSError):
            text = await self._metrics_text(w)
        if text is not None:
            if ROUTER_METRIC in text:
                # A router (this one, or another): sending it requests would loop them back.
                raise ProbeError("a prefixlb router answers there, not a worker")
            kind = detect_kind(text)
            if kind is not None:
                return kind
        await self._health(w)
        return OPENAI

    async def _health(self, w: Worker) -> None:
        assert self._session is not None
        async with self._session.get(w.url + "/health", headers=self.headers) as health:
            if health.status != 200:
                raise ProbeError(f"/health answered {health.status}")

    async def _load(self, w: Worker) -> LoadReport | None:
        assert self._session is not None
        async with self._session.get(w.url + "/load") as resp:
            if resp.status != 200:
                raise ProbeError(f"/load answered {resp.status}")
            try:
                return LoadReport.from_dict(untrusted_json.loads(await resp.content.read(MAX_LOAD_BYTES)))
            except (MessageError, json.JSONDecodeError, ValueError) as exc:
                raise ProbeError(f"/load: {exc}") from exc

    async def _metrics_text(self, w: Worker) -> str | None:
        """The body of ``GET /metrics`` (None unless 200); at most ``MAX_METRICS_BYTES``."""
        assert self._session is not None
        async with self._session.get(w.url + "/metrics", headers=self.headers) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(MAX_METRICS_BYTES + 1)
            if len(body) > MAX_METRICS_BYTES:
                return None
            return body.decode("utf-8")

    async def _engine_load(self, w: Worker, kind: str) -> LoadReport | None:
        """A vLLM / SGLang server's load from its ``/metrics`` (two scrapes give its speeds);
        None when it cannot be read: the router then counts on its own in-flight books."""
        text = None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError, OSError):
            text = await self._metrics_text(w)
        if text is None:
            return None
        now = time.time()
        try:
            scrape = parse_engine_metrics(text, now, kind)
        except (EngineMetricsError, ValueError) as exc:
            log.debug("event=engine_metrics_unreadable url=%s error=%r", w.url, str(exc)[:200])
            return None
        previous, mean_prompt = self._scrapes.get(id(w), (None, 0.0))
        report = load_report(w.worker_id or worker_id_of(w.url), scrape, previous, mean_prompt)
        if previous is not None:
            mean_prompt = mean_prompt_tokens(previous, scrape) or mean_prompt
        self._scrapes[id(w)] = (scrape, mean_prompt)
        return report

    def _note_load_source(self, w: Worker, kind: str, report: LoadReport | None) -> None:
        source = "report" if kind == PREFIXLB else ("metrics" if report is not None else "inflight")
        if source != w.load_source:
            level = logging.WARNING if source == "inflight" and kind in ENGINE_KINDS else logging.INFO
            log.log(level, "event=worker_load_source url=%s kind=%s source=%s%s", w.url, kind, source,
                    " (its /metrics cannot be read: routing on this router's in-flight requests)"
                    if source == "inflight" and kind in ENGINE_KINDS else "")
            w.load_source = source

    async def _models(self, w: Worker) -> tuple[str, ...] | None:
        assert self._session is not None
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError, AttributeError):
            async with self._session.get(w.url + "/v1/models", headers=self.headers) as resp:
                if resp.status == 200:
                    data = untrusted_json.loads(await resp.content.read(MAX_LOAD_BYTES)).get("data", [])
                    entries = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
                    for m in entries:
                        limit = m.get("max_model_len")
                        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < 2**31:
                            w.max_model_len[m["id"]] = limit
                    return tuple(m["id"] for m in entries)
        return None

    def _start(self, w: Worker, first_delay: bool = False) -> None:
        if self._session is None or id(w) in self._tasks:
            return
        self._tasks[id(w)] = asyncio.get_running_loop().create_task(self._loop(w, first_delay),
                                                                    name=f"probe {w.url}")

    def _stop(self, w: Worker) -> None:
        self._scrapes.pop(id(w), None)
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
