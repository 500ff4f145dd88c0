"""WorkerRegistry: the workers this router knows, their health state, and their models.

Workers join by ``--worker URL``, the admin API, Redis self-registration or Kubernetes
discovery. A worker is identified by the ``worker_id`` it reports about itself (``GET /load``,
or its Redis registry entry); until its first successful health check it is *joining* and gets
no traffic. States::

    joining --ok--> healthy --N failures--> unhealthy --ok--> healthy
       any --drain--> draining (no new work; removed once its requests are done)

Only *healthy* workers are routable (on the balancer's ring). The registry itself does no I/O:
``router/health.py`` probes, ``router/state.py`` reads Redis; both report here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from protocol import LoadReport, WorkerInfo
from router.balancer import Balancer

log = logging.getLogger("prefixlb.router.registry")

JOINING, HEALTHY, UNHEALTHY, DRAINING = "joining", "healthy", "unhealthy", "draining"


class InvalidWorkerURL(ValueError):
    """A worker URL that is not an absolute http(s) URL."""


def normalize_url(url: str) -> str:
    """``url`` without a trailing slash; raises :class:`InvalidWorkerURL` unless http(s)://host."""
    if not isinstance(url, str):
        raise InvalidWorkerURL("a worker URL must be a string")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidWorkerURL(f"not an http(s) worker URL: {url!r}")
    return url.strip().rstrip("/")


@dataclass(slots=True, eq=False)
class Worker:
    """One worker as the registry sees it."""

    url: str
    source: str
    worker_id: str | None = None
    state: str = JOINING
    models: tuple[str, ...] = ()
    failures: int = 0
    last_ok: float = 0.0
    last_error: str = ""

    def to_dict(self) -> dict:
        """JSON view for the admin API."""
        return {"worker_id": self.worker_id, "url": self.url, "source": self.source, "state": self.state,
                "models": list(self.models), "failures": self.failures, "last_ok": self.last_ok,
                "last_error": self.last_error}


class WorkerRegistry:
    """Known workers by URL and by id, kept in step with the balancer's routable set."""

    def __init__(self, balancer: Balancer, unhealthy_after: int = 2) -> None:
        self.balancer = balancer
        self.unhealthy_after = unhealthy_after
        self._by_url: dict[str, Worker] = {}
        self._by_id: dict[str, Worker] = {}
        self._model_exclusions: dict[str, frozenset[str]] = {}
        self.on_added: list = []     # callbacks(worker): start probing it
        self.on_removed: list = []   # callbacks(worker): stop probing it

    # -- reads ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_url)

    def all(self) -> list[Worker]:
        """Every known worker."""
        return list(self._by_url.values())

    def get(self, key: str) -> Worker | None:
        """A worker by id, or by URL."""
        return self._by_id.get(key) or self._by_url.get(key.rstrip("/"))

    def url_of(self, worker_id: str) -> str | None:
        """The base URL of ``worker_id``."""
        w = self._by_id.get(worker_id)
        return w.url if w else None

    def models(self) -> list[str]:
        """Every model a healthy worker serves, sorted."""
        return sorted({m for w in self._by_url.values() if w.state == HEALTHY for m in w.models})

    def excluded_for(self, model: str) -> frozenset[str]:
        """Routable workers that do not serve ``model`` (the policy must not pick them)."""
        cached = self._model_exclusions.get(model)
        if cached is None:
            cached = frozenset(w.worker_id for w in self._by_id.values()
                               if w.state == HEALTHY and w.models and model not in w.models)
            self._model_exclusions[model] = cached
        return cached

    # -- membership -------------------------------------------------------------------------
    def add(self, url: str, source: str, worker_id: str | None = None) -> Worker:
        """Know a worker at ``url`` (idempotent); it is routable after its first good check."""
        url = normalize_url(url)
        w = self._by_url.get(url)
        if w is not None:
            return w
        if worker_id is not None and worker_id in self._by_id:
            return self._by_id[worker_id]  # the same worker, known under another URL
        w = Worker(url, source, worker_id)
        self._by_url[url] = w
        if worker_id is not None:
            self._by_id[worker_id] = w
        log.info("event=worker_added url=%s source=%s worker_id=%s", url, source, worker_id)
        for callback in self.on_added:
            callback(w)
        return w

    def remove(self, key: str) -> Worker | None:
        """Forget a worker (by id or URL); its index entries and load go with it."""
        w = self.get(key)
        if w is None:
            return None
        self._by_url.pop(w.url, None)
        if w.worker_id is not None and self._by_id.get(w.worker_id) is w:
            del self._by_id[w.worker_id]
            self.balancer.remove_worker(w.worker_id)
        self._changed()
        log.info("event=worker_removed url=%s worker_id=%s", w.url, w.worker_id)
        for callback in self.on_removed:
            callback(w)
        return w

    def drain(self, key: str) -> Worker | None:
        """Stop sending new work to a worker; it is removed once nothing is in flight there."""
        w = self.get(key)
        if w is None:
            return None
        self._set_state(w, DRAINING)
        return w

    # -- health -----------------------------------------------------------------------------
    def mark_ok(self, w: Worker, now: float, report: LoadReport | None = None,
                info: WorkerInfo | None = None, models: tuple[str, ...] | None = None) -> None:
        """A successful probe (with the worker's load report / registry entry if any)."""
        if w.url not in self._by_url:
            return  # removed meanwhile
        reported = (report.worker_id if report else None) or (info.worker_id if info else None)
        if w.worker_id is not None and reported and reported != w.worker_id:
            log.warning("event=worker_id_mismatch url=%s known_as=%s reports=%s", w.url, w.worker_id, reported)
        worker_id = w.worker_id or reported or w.url.split("://", 1)[-1]
        if w.worker_id is None:
            other = self._by_id.get(worker_id)
            if other is not None and other is not w:
                # Two URLs for one worker (e.g. --worker and its Redis advertise URL): keep one.
                log.info("event=worker_duplicate url=%s worker_id=%s kept=%s", w.url, worker_id, other.url)
                self.remove(w.url)
                return
            w.worker_id = worker_id
            self._by_id[worker_id] = w
        w.failures = 0
        w.last_ok = now
        w.last_error = ""
        if models:
            w.models = tuple(models)
        elif info is not None and info.model and info.model not in w.models:
            w.models = w.models + (info.model,)
        block_size = report.block_size if report else (info.block_size if info else None)
        max_num_seqs = report.max_num_seqs if report else (info.max_num_seqs if info else None)
        if worker_id not in self.balancer.board:
            self.balancer.add_worker(worker_id, block_size, max_num_seqs or None, routable=False)
        if report is not None:
            self.balancer.apply_report(report, now)
        status = (report.status if report else None) or (info.status if info else None)
        if status == DRAINING:
            self._set_state(w, DRAINING)
        elif w.state != DRAINING:
            self._set_state(w, HEALTHY)
        self._changed()

    def note_info(self, w: Worker, info: WorkerInfo) -> None:
        """A registry entry the worker published (Redis): its model and status, not its health.

        Liveness stays with the active probes, so a worker that heartbeats into Redis but cannot
        be reached from here does not flap in and out of rotation.
        """
        if info.model and info.model not in w.models:
            w.models = w.models + (info.model,)
            self._changed()
        if info.status == DRAINING:
            self._set_state(w, DRAINING)

    def mark_failed(self, w: Worker, error: str) -> None:
        """A failed probe; ``unhealthy_after`` in a row take the worker out of rotation."""
        w.failures += 1
        w.last_error = error
        if w.failures >= self.unhealthy_after and w.state in (HEALTHY, JOINING):
            self._set_state(w, UNHEALTHY)

    def _set_state(self, w: Worker, state: str) -> None:
        if w.state == state:
            return
        log.info("event=worker_state url=%s worker_id=%s from=%s to=%s error=%r", w.url, w.worker_id,
                 w.state, state, w.last_error)
        w.state = state
        if w.worker_id is not None and w.worker_id in self.balancer.board:
            self.balancer.set_routable(w.worker_id, state == HEALTHY)
        self._changed()

    def _changed(self) -> None:
        self._model_exclusions.clear()
