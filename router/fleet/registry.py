"""WorkerRegistry: the workers this router knows, their health state, and their models.

Workers join by ``--worker URL``, the admin API, Redis self-registration or Kubernetes
discovery (every URL is checked by ``router/fleet/worker_url.py`` first). A worker is identified by
the ``worker_id`` it reports about itself (``GET /load``, or its Redis registry entry); until its
first successful health check it is *joining* and gets no traffic. States::

    joining --ok--> [warming: pre-warm requests] --> healthy
    healthy --breaker opens--> unhealthy --cool-down + good probe--> [warming] --> recovering --successes--> healthy
                                  ^                                      |
                                  +------------- one failure ------------+
    any --drain--> draining --nothing in flight here--> drained (or removed)

*healthy* and *recovering* workers are routable (on the balancer's ring); a *recovering* one
(breaker half-open) takes at most ``half_open_max_inflight`` of this router's requests at once.
The breaker (``router/fleet/breaker.py``) counts failures of real requests (passive) and of probes
(active) alike; when it opens, the worker's prefix-index entries are dropped (only its keys
move to their ring neighbours) and ``on_unavailable`` callbacks let the proxy abandon
requests stuck there.

Draining: a drain asked through the admin API is sticky (discovery does not bring the worker
back; re-adding its URL through the admin API does); a worker draining itself (SIGTERM) reports
``draining`` and is routable again if it later reports ``ready`` (a restart). Once nothing of
this router is in flight there, a drained worker is removed if it came from ``--worker`` or the
admin API, else kept as *drained* until it leaves its discovery source.

The registry does no I/O: ``router/fleet/health.py`` probes, ``router/state.py`` reads Redis, the
proxy reports request outcomes; all report here.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

from protocol import LoadReport, WorkerInfo
from router.routing.balancer import Balancer
from router.fleet.backends import WorkerSpec, check_zmq_endpoint
from router.fleet.breaker import Breaker, BreakerConfig
from router.fleet.worker_url import InvalidWorkerURL, WorkerURLPolicy, normalize_url

__all__ = ["InvalidWorkerURL", "normalize_url", "worker_id_of", "Worker", "WorkerRegistry", "JOINING", "WARMING",
           "HEALTHY", "RECOVERING", "UNHEALTHY", "DRAINING", "DRAINED", "STATES", "ROUTABLE"]

log = logging.getLogger("prefixlb.router.registry")

JOINING, WARMING, HEALTHY, RECOVERING = "joining", "warming", "healthy", "recovering"
UNHEALTHY, DRAINING, DRAINED = "unhealthy", "draining", "drained"
STATES = (JOINING, WARMING, HEALTHY, RECOVERING, UNHEALTHY, DRAINING, DRAINED)
ROUTABLE = (HEALTHY, RECOVERING)
STATIC_SOURCES = ("flag", "admin")  # sources nothing re-adds a worker from
REDIS_SOURCE = "redis"  # a worker's own registration in Redis (router/state.py)


@dataclass(slots=True, eq=False)
class Worker:
    """One worker as the registry sees it."""

    url: str
    source: str
    worker_id: str | None = None
    state: str = JOINING
    models: tuple[str, ...] = ()
    breaker: Breaker = field(default_factory=Breaker)
    admin_drain: bool = False
    drain_shared: bool = False  # the admin drain is in Redis (published here or adopted from there)
    last_ok: float = 0.0
    last_error: str = ""
    vanished_at: float | None = None  # when it left its discovery source (Redis grace)
    after_warming: str = HEALTHY  # the state pre-warming leads to (recovering, after an outage)
    kind: str | None = None  # as configured (None: detected by the prober, router/fleet/backends.py)
    detected_kind: str | None = None  # what the prober found it to be
    kv_events: str | None = None  # ZMQ endpoints of its KV-event publisher and replay socket (vLLM)
    kv_replay: str | None = None
    load_source: str = ""  # where its load comes from: report, metrics, inflight (the router's own books)
    max_model_len: dict[str, int] = field(default_factory=dict)  # per model, from /v1/models
    adapters: tuple[str, ...] = ()  # LoRA adapters it serves now, by its load report: models a request may name

    @property
    def backend_kind(self) -> str | None:
        """Its kind: as configured, else as detected (None until the first good probe)."""
        return self.kind or self.detected_kind

    @property
    def failures(self) -> int:
        """Consecutive failed requests / probes."""
        return self.breaker.failures

    def to_dict(self) -> dict:
        """JSON view for the admin API."""
        return {"worker_id": self.worker_id, "url": self.url, "source": self.source, "state": self.state,
                "models": list(self.models), "adapters": list(self.adapters), "kind": self.backend_kind, "load_source": self.load_source or None,
                "kv_events": self.kv_events, "max_model_len": dict(self.max_model_len), "failures": self.failures,
                "breaker": self.breaker.state,
                "breaker_opens": self.breaker.opens, "last_ok": self.last_ok, "last_error": self.last_error}


def worker_id_of(url: str) -> str:
    """The id of a worker that names none itself (vLLM, SGLang): its URL's host and port."""
    return url.split("://", 1)[-1]


# warmup(w, warmed): True when it pre-warms ``w`` first and calls ``warmed(w)`` once done.
Warmup = Callable[[Worker, Callable[[Worker], None]], bool]


class WorkerRegistry:
    """Known workers by URL and by id, kept in step with the balancer's routable set."""

    def __init__(self, balancer: Balancer, unhealthy_after: int = 2, breaker: BreakerConfig | None = None,
                 half_open_max_inflight: int = 2, url_policy: WorkerURLPolicy | None = None,
                 warmup: Warmup | None = None, on_routable: Iterable[Callable[[str], None]] = ()) -> None:
        """``warmup(w, warmed)`` is asked about every worker about to take traffic: True means it
        warms ``w`` first and calls ``warmed(w)`` when done (pre-warming); ``on_routable`` callbacks
        hear of every worker that takes new requests now."""
        self.balancer = balancer
        self.breaker_config = breaker if breaker is not None else BreakerConfig(failure_threshold=unhealthy_after)
        self.half_open_max_inflight = half_open_max_inflight
        self.url_policy = url_policy if url_policy is not None else WorkerURLPolicy()
        self._by_url: dict[str, Worker] = {}
        self._by_id: dict[str, Worker] = {}
        self._model_exclusions: dict[str, frozenset[str]] = {}
        self._models: list[str] | None = None  # models(), until the next change (read per request)
        self.on_added: list[Callable[[Worker], None]] = []      # start probing it
        self.on_removed: list[Callable[[Worker], None]] = []    # stop probing it
        self.on_unavailable: list[Callable[[str], None]] = []   # breaker opened: abandon its requests
        self.on_routable: list[Callable[[str], None]] = list(on_routable)  # it takes new requests now
        self.warmup = warmup

    # -- reads ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_url)

    def all(self) -> list[Worker]:
        """Every known worker."""
        return list(self._by_url.values())

    def get(self, key: str) -> Worker | None:
        """A worker by id, or by URL."""
        return self._by_id.get(key) or self._by_url.get(key.rstrip("/"))

    def knows_id(self, worker_id: str) -> bool:
        """True for the id of a worker this registry knows."""
        return worker_id in self._by_id

    def url_of(self, worker_id: str) -> str | None:
        """The base URL of ``worker_id``."""
        w = self._by_id.get(worker_id)
        return w.url if w else None

    def models(self) -> list[str]:
        """Every model a routable worker serves, sorted."""
        models = self._models
        if models is None:
            models = self._models = sorted({m for w in self._by_url.values() if w.state in ROUTABLE
                                            for m in (*w.models, *w.adapters)})
        return list(models)

    def excluded_for(self, model: str) -> frozenset[str]:
        """Routable workers that do not serve ``model`` (the policy must not pick them)."""
        cached = self._model_exclusions.get(model)
        if cached is None:
            cached = frozenset(w.worker_id for w in self._by_id.values()
                               if w.state in ROUTABLE and w.models and model not in w.models
                               and model not in w.adapters)
            self._model_exclusions[model] = cached
        return cached

    # -- membership -------------------------------------------------------------------------
    def add(self, url: str, source: str, worker_id: str | None = None, spec: WorkerSpec | None = None) -> Worker:
        """Know a worker at ``url`` (idempotent); it is routable after its first good check.

        ``spec`` gives its kind and KV-event sockets (``router/fleet/backends.py``); a worker
        already known keeps what it was added with. Raises :class:`InvalidWorkerURL` for a URL
        (or a KV-event endpoint host) the policy refuses.
        """
        url = self.url_policy.check(url)
        if spec is not None:
            for endpoint in (spec.kv_events, spec.kv_replay):
                if endpoint:
                    self.url_policy.check_host(check_zmq_endpoint(endpoint)[0])
        w = self._by_url.get(url)
        if w is None and worker_id is not None:
            w = self._by_id.get(worker_id)  # the same worker, known under another URL
            if w is not None and source == REDIS_SOURCE and w.source == REDIS_SOURCE:
                # It registered again at a new address (a rescheduled pod keeps its name, not its
                # IP): the registration is the truth, the old address goes.
                log.info("event=worker_moved worker_id=%s from=%s to=%s", worker_id, w.url, url)
                self.remove(w.url)
                w = None
        if w is not None:
            if source == "admin" and w.admin_drain:
                self.undrain(w)
            return w
        w = Worker(url, source, worker_id, breaker=Breaker(self.breaker_config))
        if spec is not None:
            w.kind, w.kv_events, w.kv_replay = spec.kind, spec.kv_events, spec.kv_replay
        self._by_url[url] = w
        if worker_id is not None:
            self._by_id[worker_id] = w
        log.info("event=worker_added url=%s source=%s worker_id=%s kind=%s kv_events=%s", url, source, worker_id,
                 w.kind or "detect", w.kv_events)
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
        """Admin drain: no new work for the worker; removed (or kept as drained) once idle here."""
        w = self.get(key)
        if w is None:
            return None
        w.admin_drain = True
        if w.state != DRAINED:
            self._set_state(w, DRAINING)
        return w

    def undrain(self, w: Worker) -> None:
        """Cancel an admin drain: the worker joins again at its next good probe."""
        w.admin_drain = False
        w.drain_shared = False
        if w.state in (DRAINING, DRAINED):
            self._set_state(w, JOINING)

    def drained(self, w: Worker) -> None:
        """A draining worker has nothing of ours in flight any more."""
        if w.state != DRAINING:
            return
        if w.admin_drain and w.source in STATIC_SOURCES:
            self.remove(w.url)
            return
        self._set_state(w, DRAINED)

    def warmed(self, w: Worker) -> None:
        """Pre-warming of a joining (or recovering) worker is over: it takes traffic now."""
        if w.state == WARMING:
            self._set_state(w, w.after_warming)

    # -- health -----------------------------------------------------------------------------
    def mark_ok(self, w: Worker, now: float, report: LoadReport | None = None,
                info: WorkerInfo | None = None, models: tuple[str, ...] | None = None) -> None:
        """A successful probe (with the worker's load report / registry entry if any)."""
        if w.url not in self._by_url:
            return  # removed meanwhile
        reported = (report.worker_id if report else None) or (info.worker_id if info else None)
        if w.worker_id is not None and reported and reported != w.worker_id:
            log.warning("event=worker_id_mismatch url=%s known_as=%s reports=%s", w.url, w.worker_id, reported)
        worker_id = w.worker_id or reported or worker_id_of(w.url)
        if w.worker_id is None:
            other = self._by_id.get(worker_id)
            if other is not None and other is not w:
                # Two URLs for one worker (e.g. --worker and its Redis advertise URL): keep one.
                log.info("event=worker_duplicate url=%s worker_id=%s kept=%s", w.url, worker_id, other.url)
                self.remove(w.url)
                return
            w.worker_id = worker_id
            self._by_id[worker_id] = w
        w.last_ok = now
        w.last_error = ""
        if models:
            w.models = tuple(models)
        elif info is not None and info.model and info.model not in w.models:
            w.models = w.models + (info.model,)
        if report is not None:
            # The adapters it serves now (loaded at start or at run time): /v1/models is read once.
            w.adapters = adapter_names(report)
        if report is not None and report.worker_id != worker_id:
            # A report is about the worker that was probed, whatever id it names.
            report = dataclasses.replace(report, worker_id=worker_id)
        block_size = report.block_size if report else (info.block_size if info else None)
        max_num_seqs = report.max_num_seqs if report else (info.max_num_seqs if info else None)
        if worker_id not in self.balancer.board:
            self.balancer.add_worker(worker_id, block_size, max_num_seqs or None, routable=False)
        if report is not None:
            self.balancer.apply_report(report, now)
        status = (report.status if report else None) or (info.status if info else None)
        self._changed()
        if status == DRAINING:
            if w.state != DRAINED:
                self._set_state(w, DRAINING)
            return
        if w.admin_drain:
            return
        state = w.state
        if state in (JOINING, DRAINING, DRAINED):
            # A new worker, or one that drained itself and reports ready again (restarted).
            w.breaker = Breaker(self.breaker_config)
            self._warm_then(w, HEALTHY)
        elif state == UNHEALTHY:
            if w.breaker.record_probe_ok(now):
                # Its index entries were dropped when it failed; a stopped (not crashed) worker
                # still has its cache, and pre-warming re-learns and refills the hot part of it.
                self._warm_then(w, RECOVERING)
        elif w.breaker.record_success(now) and state == RECOVERING:
            self._set_state(w, HEALTHY)

    def _warm_then(self, w: Worker, state: str) -> None:
        w.after_warming = state
        if self.warmup is not None and self.warmup(w, self.warmed):
            self._set_state(w, WARMING)
        else:
            self._set_state(w, state)

    def note_info(self, w: Worker, info: WorkerInfo) -> None:
        """A registry entry the worker published (Redis): its model and status, not its health.

        Liveness stays with the active probes, so a worker that heartbeats into Redis but cannot
        be reached from here does not flap in and out of rotation.
        """
        w.vanished_at = None
        if info.model and info.model not in w.models:
            w.models = w.models + (info.model,)
            self._changed()
        if info.status == DRAINING and w.state not in (DRAINING, DRAINED):
            self._set_state(w, DRAINING)

    def mark_failed(self, w: Worker, error: str, now: float, refused: bool = False) -> None:
        """A failed probe or request; ``unhealthy_after`` in a row open the worker's breaker, and
        so does a single ``refused`` connection (nothing listens there)."""
        w.last_error = error
        if w.breaker.record_failure(now, refused) and w.state in (JOINING, WARMING, HEALTHY, RECOVERING):
            self._set_state(w, UNHEALTHY)

    def request_ok(self, worker_id: str, now: float) -> None:
        """A request to ``worker_id`` succeeded (passive evidence; closes a half-open breaker)."""
        w = self._by_id.get(worker_id)
        if w is not None and w.breaker.record_success(now) and w.state == RECOVERING:
            self._set_state(w, HEALTHY)

    def report_draining(self, worker_id: str) -> None:
        """The worker refused a request because it is draining (it will say so at its next probe)."""
        w = self._by_id.get(worker_id)
        if w is not None and w.state not in (DRAINING, DRAINED):
            self._set_state(w, DRAINING)

    def _set_state(self, w: Worker, state: str) -> None:
        if w.state == state:
            return
        log.info("event=worker_state url=%s worker_id=%s from=%s to=%s error=%r", w.url, w.worker_id,
                 w.state, state, w.last_error)
        old, w.state = w.state, state
        worker_id = w.worker_id
        if worker_id is not None and worker_id in self.balancer.board:
            self.balancer.set_routable(worker_id, state in ROUTABLE)
            if state == RECOVERING:
                self.balancer.board.set_cap(worker_id, self.half_open_max_inflight)
            elif old == RECOVERING:
                self.balancer.board.set_cap(worker_id, 0)
            if state in (UNHEALTHY, DRAINED):
                # Its cache is gone or about to be: forget what it held (its keys move on the ring).
                self.balancer.index.clear_worker(worker_id)
                self.balancer.precise.reset(worker_id)
        self._changed()
        if worker_id is None:
            return
        if state == UNHEALTHY:
            for callback in self.on_unavailable:
                callback(worker_id)
        elif state in ROUTABLE and old not in ROUTABLE:
            for callback in self.on_routable:
                callback(worker_id)

    def _changed(self) -> None:
        self._model_exclusions.clear()
        self._models = None


MAX_ADAPTER_MODELS = 4096  # adapter names taken from one worker's report at most


def adapter_names(report: LoadReport) -> tuple[str, ...]:
    """The LoRA adapters a worker's load report says it serves (bounded, valid names only)."""
    adapters = report.lora_adapters if isinstance(report.lora_adapters, dict) else {}
    names = [a for a in adapters if isinstance(a, str) and 0 < len(a) <= 256]
    return tuple(names[:MAX_ADAPTER_MODELS])
