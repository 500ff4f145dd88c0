"""RouterContext: one router's parts wired together, and their start-up and shutdown order.

Built without I/O (:func:`build_context`); :func:`start` opens connections, synchronises from
Redis and starts the background tasks *before* the HTTP server listens; :func:`stop` undoes it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol import RedisKeys
from protocol.settings import SettingsError, parse_setting
from protocol.version import version
from router.http.admission import Admission
from router.routing.balancer import Balancer
from router.fleet.breaker import BreakerConfig
from router.fleet.connections import WorkerConnections
from router.config import RouterConfig, load_virtual_model_files
from router.cost.accounting import CostAccounting
from router.fleet.backends import parse_worker_spec
from router.fleet.health import HealthChecker
from router.fleet.kv_subscriber import KVEventSubscriber
from router.routing.index import PrefixIndex
from router.routing.load import LoadBoard
from router.lora_metrics import adapter_metrics
from router.metrics import RouterMetrics
from router.fleet.prewarm import HotPrefixes, Prewarmer
from router.http.proxy import Proxy
from router.fleet.registry import ROUTABLE, STATES, InvalidWorkerURL, Worker, WorkerRegistry, worker_id_of
from router.state import RedisState
from router.fleet.worker_url import WorkerURLPolicy
from router.virtual_models.metrics import VirtualModelMetrics

log = logging.getLogger("prefixlb.router")

RUNTIME_KEYS = ("affinity", "policy", "prewarm_top")
SWEEP_INTERVAL_S = 5.0
SWEEP_BUDGET = 20_000  # hashes looked at per sweep (a few ms)


class ConfigError(ValueError):
    """A runtime config change that is not valid."""


@dataclass(eq=False)
class RouterContext:
    """Everything one router process holds."""

    config: RouterConfig
    balancer: Balancer
    registry: WorkerRegistry
    metrics: RouterMetrics
    proxy: Proxy
    health: HealthChecker
    prewarmer: Prewarmer
    connections: WorkerConnections
    kv_events: KVEventSubscriber
    tokenizers: Any = None  # BackendTokenizers (router/routing/chat_tokens.py) when --tokenizer is given
    state: RedisState | None = None
    discovery: Any = None
    maintenance: asyncio.Task | None = None
    started: bool = False
    # Virtual models (router/virtual_models/): name -> RouteModel | CascadeModel, replaced whole
    # by PUT /admin/virtual-models; their metrics; the price book and ledger every answer feeds.
    virtual_models: dict[str, Any] = dataclasses.field(default_factory=dict)
    virtual_metrics: Any = None
    costs: CostAccounting = dataclasses.field(default_factory=CostAccounting)
    siblings: Any = None  # router/http/siblings.Siblings with --processes > 1
    front: Any = None  # router/http/front.Front serving the port (None: aiohttp alone, or not listening)
    scoring_session: Any = None  # aiohttp session of route classifiers and verifier judges (opened on first use)

    def subscribe_kv_events(self, w: Worker) -> None:
        """Read ``w``'s KV events if it publishes them (a vLLM worker added with ``kv-events``)."""
        if self.started and w.kv_events:
            # the id the balancer will know it by (its own, or its URL's host:port)
            self.kv_events.add(w.worker_id or worker_id_of(w.url), w.kv_events, w.kv_replay)

    def unsubscribe_kv_events(self, w: Worker) -> None:
        """``w`` left: stop reading its KV events."""
        if w.kv_events:
            self.kv_events.remove(w.worker_id or worker_id_of(w.url))

    def runtime_config(self) -> dict[str, Any]:
        """The settings that can change at run time, as in force now."""
        return {"affinity": self.config.affinity, "policy": self.config.policy,
                "prewarm_top": self.config.prewarm_top}

    def apply_runtime(self, values: dict[str, Any]) -> dict[str, Any]:
        """Validate and apply ``affinity`` / ``policy`` / ``prewarm_top`` changes; returns the new
        runtime config.

        Each value is converted and checked by the settings schema (``RouterConfig``'s types,
        choices and ranges, as at start-up); nothing is applied unless all of them are valid.
        """
        unknown = sorted(set(values) - set(RUNTIME_KEYS))
        if unknown:
            raise ConfigError(f"not changeable at run time: {', '.join(unknown)}")
        try:
            checked = {name: parse_setting(RouterConfig, name, value) for name, value in values.items()}
        except SettingsError as exc:
            raise ConfigError(str(exc)) from None
        affinity = checked.get("affinity", self.config.affinity)
        policy = checked.get("policy", self.config.policy)
        prewarm_top = checked.get("prewarm_top", self.config.prewarm_top)
        self.config.affinity = affinity
        self.config.policy = policy
        self.config.prewarm_top = prewarm_top
        self.prewarmer.set_top(prewarm_top)
        self.balancer.config = dataclasses.replace(self.balancer.config, affinity=affinity, policy=policy)
        log.info("event=config_applied affinity=%s policy=%s prewarm_top=%d", affinity, policy, prewarm_top)
        return self.runtime_config()

    def _shared_config(self, values: dict[str, str]) -> None:
        try:
            self.apply_runtime({k: v for k, v in values.items() if k in RUNTIME_KEYS})
        except ConfigError as exc:
            log.warning("event=shared_config_refused error=%s", exc)

    def state_metrics(self) -> Iterable[Any]:
        """Scrape-time gauges: index, workers, Redis."""
        index = self.balancer.index
        yield _gauge("prefixlb_router_index_entries", "Chain hashes in the prefix index", len(index))
        yield _gauge("prefixlb_router_index_capacity_entries", "Prefix-index capacity", index.max_entries)
        evicted = CounterMetricFamily("prefixlb_router_index_evictions", "Index entries dropped, by reason",
                                      labels=["reason"])
        evicted.add_metric(["lru"], index.stats.evicted_lru)
        evicted.add_metric(["expired"], index.stats.expired)
        evicted.add_metric(["removed_event"], index.stats.removed)
        yield evicted
        gaps = CounterMetricFamily("prefixlb_router_kv_event_gaps", "Gaps seen in workers' KV-event sequence")
        gaps.add_metric([], self.balancer.event_gaps)
        yield gaps
        states = GaugeMetricFamily("prefixlb_router_workers", "Known workers by state", labels=["state"])
        counts = {s: 0 for s in STATES}
        for w in self.registry.all():
            counts[w.state] = counts.get(w.state, 0) + 1
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states
        healthy = GaugeMetricFamily("prefixlb_router_worker_healthy", "1 if the worker takes new requests",
                                    labels=["worker"])
        inflight = GaugeMetricFamily("prefixlb_router_worker_inflight_requests",
                                     "Requests in the worker's system (its report + sent since)", labels=["worker"])
        pending = GaugeMetricFamily("prefixlb_router_worker_pending_seconds",
                                    "Predicted seconds of work ahead of a new request", labels=["worker"])
        now = time.time()
        for w in self.registry.all():
            if w.worker_id is None:
                continue
            healthy.add_metric([w.worker_id], 1.0 if w.state in ROUTABLE else 0.0)
            load = self.balancer.board.get(w.worker_id)
            if load is not None:
                inflight.add_metric([w.worker_id], load.in_system)
                pending.add_metric([w.worker_id], load.pending_s(now))
        yield healthy
        yield inflight
        yield pending
        source = GaugeMetricFamily("prefixlb_router_worker_load_source",
                                   "1 for where a worker's load comes from: report (prefixlb), metrics (vLLM / "
                                   "SGLang /metrics), inflight (this router's own books only)",
                                   labels=["worker", "kind", "source"])
        for w in self.registry.all():
            if w.worker_id is not None and w.load_source:
                source.add_metric([w.worker_id, w.backend_kind or "", w.load_source], 1.0)
        yield source
        precise = GaugeMetricFamily("prefixlb_router_kv_events_synchronised",
                                    "1 while a backend's KV-event stream is synchronised (exact cached-token "
                                    "predictions), 0 while it is routed on estimates", labels=["worker"])
        blocks = GaugeMetricFamily("prefixlb_router_kv_events_blocks", "Blocks a backend holds by its KV events",
                                   labels=["worker"])
        kv = CounterMetricFamily("prefixlb_router_engine_kv_event_batches",
                                 "vLLM KV-event batches read from a backend's ZMQ publisher, and mishaps (what: "
                                 "batches, malformed, gaps, restarts, resyncs, resync_failures)",
                                 labels=["worker", "what"])
        for backend, st in list(self.kv_events.stats.items()):
            precise.add_metric([backend], 1.0 if self.balancer.precise.precise(backend) else 0.0)
            blocks.add_metric([backend], self.balancer.precise.index.num_blocks(backend))
            for what in ("batches", "malformed", "gaps", "restarts", "resyncs", "resync_failures"):
                kv.add_metric([backend, what], getattr(st, what))
        yield precise
        yield blocks
        yield kv
        ratio = GaugeMetricFamily("prefixlb_router_tokens_per_byte", "Learned prompt tokens per rendered byte",
                                  labels=["model"])
        for model, value in self.balancer.token_ratios().items():
            ratio.add_metric([model], value)
        yield ratio
        yield _gauge("prefixlb_router_affinity", "Affinity strength in force", self.config.affinity)
        build = GaugeMetricFamily("prefixlb_router_build_info", "1, labelled with the running prefixlb's version",
                                  labels=["version", "component"])
        build.add_metric([version(), "router"], 1.0)
        yield build
        if self.siblings is None:  # with --processes N the merged view says (router/http/siblings.py)
            yield _gauge("prefixlb_router_processes", "Processes this router runs (--processes)", 1)
            yield _gauge("prefixlb_router_processes_answering", "Processes whose metrics this scrape merged", 1)
        admission = self.proxy.admission
        yield _gauge("prefixlb_router_inflight_requests", "Requests admitted and not finished", admission.inflight)
        yield _gauge("prefixlb_router_queued_requests", "Requests waiting for capacity", len(admission))
        opens = CounterMetricFamily("prefixlb_router_breaker_opens", "Times a worker's breaker opened",
                                    labels=["worker"])
        for w in self.registry.all():
            if w.worker_id is not None:
                opens.add_metric([w.worker_id], w.breaker.opens)
        yield opens
        if self.state is not None:
            yield _gauge("prefixlb_router_redis_up", "1 while every Redis task succeeds",
                         1.0 if self.state.status() == "up" else 0.0)
            age = GaugeMetricFamily("prefixlb_router_loop_age_seconds",
                                    "Seconds since a Redis loop last came round (a stuck one turns /health 503)",
                                    labels=["task"])
            now = time.monotonic()
            for task, (seen, _) in sorted(self.state.loop_seen.items()):
                age.add_metric([task], now - seen)
            yield age


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, documentation)
    g.add_metric([], value)
    return g


def build_context(cfg: RouterConfig) -> RouterContext:
    """Wire the parts from ``cfg`` (no I/O yet)."""
    index = PrefixIndex(cfg.index_max_entries, cfg.index_optimistic_ttl, cfg.index_confirmed_ttl)
    board = LoadBoard(cfg.speed_profile(), max_inflight=cfg.max_inflight_per_worker)
    balancer = Balancer(cfg.policy_config(), cfg.chunk_size, index, board, cfg.tokens_per_byte,
                        feedback_clear_after=cfg.feedback_clear_after, vnodes=cfg.vnodes)
    breaker = BreakerConfig(failure_threshold=cfg.unhealthy_after, cool_down_s=cfg.breaker_cool_down,
                            max_cool_down_s=max(cfg.breaker_cool_down, cfg.breaker_max_cool_down),
                            half_open_successes=cfg.half_open_successes)
    metrics = RouterMetrics()
    admission = Admission(cfg.max_inflight, cfg.max_queue, cfg.max_queue_bytes, cfg.queue_timeout)
    connections = WorkerConnections(cfg.connect_timeout, cfg.read_timeout)
    worker_headers = {"Authorization": f"Bearer {cfg.worker_api_key}"} if cfg.worker_api_key else {}
    hot = HotPrefixes(max(32, 4 * cfg.prewarm_top), cfg.prewarm_max_bytes)
    prewarmer = Prewarmer(hot, cfg.prewarm_top, cfg.prewarm_timeout, connections, balancer, metrics,
                          cfg.chunk_size, cfg.ring_key_chunks, worker_headers)
    registry = WorkerRegistry(balancer, cfg.unhealthy_after, breaker, cfg.half_open_max_inflight,
                              WorkerURLPolicy(cfg.worker_allow), warmup=prewarmer.wants,
                              # A worker coming back (or a new one) is capacity for requests in the queue.
                              on_routable=[lambda worker_id: admission.notify()])
    proxy = Proxy(balancer, registry, metrics, connections, cfg.max_attempts, cfg.retry_deadline, admission)
    health = HealthChecker(registry, cfg.health_interval, cfg.health_jitter, cfg.health_timeout, worker_headers)
    state = None
    if cfg.redis:
        # Shared runtime config is applied to the context built just below; Redis delivers it
        # only after start(), when ``ctx`` is bound.
        state = RedisState(cfg.redis, RedisKeys(cfg.redis_prefix), balancer, registry, metrics,
                           cfg.registry_interval, cfg.snapshot_interval, lambda values: ctx._shared_config(values),
                           registry_grace=cfg.registry_grace, signing_secret=cfg.redis_signing_secret)
    tokenizers = None
    if cfg.tokenizers:
        from router.fleet.tokenizers import load_backend_tokenizers

        tokenizers = load_backend_tokenizers(dict(entry.split("=", 1) for entry in cfg.tokenizers))
    ctx = RouterContext(config=cfg, balancer=balancer, registry=registry, metrics=metrics, proxy=proxy,
                        health=health, prewarmer=prewarmer, connections=connections,
                        kv_events=KVEventSubscriber(balancer.precise), tokenizers=tokenizers, state=state)
    metrics.add_state(ctx.state_metrics)
    ctx.virtual_models, book = load_virtual_model_files(cfg)
    ctx.costs = CostAccounting(book)
    ctx.virtual_metrics = VirtualModelMetrics(metrics.registry)
    metrics.add_state(ctx.costs.families)
    metrics.add_state(lambda: adapter_metrics(balancer.adapters))
    registry.on_added.append(ctx.subscribe_kv_events)
    registry.on_removed.append(ctx.unsubscribe_kv_events)
    for text in cfg.workers:
        spec = parse_worker_spec(text)
        registry.add(spec.url, "flag", spec=spec)
    return ctx


async def start(ctx: RouterContext) -> None:
    """Open connections, sync from Redis, start probes and discovery (before listening)."""
    await ctx.connections.open()
    ctx.started = True
    for w in ctx.registry.all():
        ctx.subscribe_kv_events(w)
    if ctx.state is not None:
        await ctx.state.start(ctx.config.startup_sync_timeout)
    await ctx.health.start()
    ctx.prewarmer.start()
    ctx.maintenance = asyncio.get_running_loop().create_task(_sweep_index(ctx))
    if ctx.config.k8s_selector:
        from router.fleet import k8s_discovery
        ctx.discovery = k8s_discovery.start(_DiscoverySink(ctx.registry), ctx.config.k8s_selector,
                                            ctx.config.k8s_namespace, ctx.config.k8s_port)


async def stop(ctx: RouterContext) -> None:
    """Stop everything :func:`start` started."""
    if ctx.discovery is not None:
        # The watch ends only at its next event or server timeout: wait for its (daemon) thread
        # off the event loop, so in-flight requests and the Redis shutdown are not held up.
        await asyncio.get_running_loop().run_in_executor(None, ctx.discovery.stop)
    if ctx.maintenance is not None:
        ctx.maintenance.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ctx.maintenance
    await ctx.prewarmer.close()
    await ctx.health.close()
    await ctx.kv_events.close()
    if ctx.state is not None:
        await ctx.state.close(final_snapshot=True)
    if ctx.scoring_session is not None:
        await ctx.scoring_session.close()
    await ctx.connections.close()


async def _sweep_index(ctx: RouterContext) -> None:
    """Drop expired index entries, oldest first, a bounded slice every few seconds."""
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        ctx.balancer.index.sweep(time.time(), SWEEP_BUDGET)


class _DiscoverySink:
    """Kubernetes discovery's view of the registry (workers it found, by pod name and IP)."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def add_worker(self, worker_id: str, url: str) -> None:
        try:
            self.registry.add(url, "k8s", worker_id)
        except InvalidWorkerURL as exc:
            log.warning("event=worker_url_refused source=k8s worker_id=%s error=%s", worker_id, exc)

    def remove_worker(self, worker_id: str) -> None:
        self.registry.remove(worker_id)
