"""RouterMetrics: the router's Prometheus metrics (``GET /metrics``), one registry per app.

Names follow Prometheus conventions: ``prefixlb_router_`` prefix, ``_total`` counters, base
units in the name (``_seconds``, ``_tokens``). Gauges that describe state (index size, worker
health) are read at scrape time by a collector, never updated on the request path.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
TOKEN_ERROR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return self._read()


class RouterMetrics:
    """Counters and histograms updated by the request path, plus scrape-time gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("prefixlb_router_requests_total",
                                "Requests routed, by worker and decision reason", ["worker", "reason"], registry=r)
        self.responses = Counter("prefixlb_router_responses_total",
                                 "Responses sent to clients, by HTTP status code", ["code"], registry=r)
        self.decision_seconds = Histogram("prefixlb_router_decision_seconds",
                                          "Time to decide a worker (index lookup + policy)",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.predicted_cached = Counter("prefixlb_router_predicted_cached_tokens_total",
                                        "Cached prompt tokens the router predicted", ["worker"], registry=r)
        self.reported_cached = Counter("prefixlb_router_reported_cached_tokens_total",
                                       "Cached prompt tokens the workers reported", ["worker"], registry=r)
        self.prompt_tokens = Counter("prefixlb_router_prompt_tokens_total",
                                     "Prompt tokens the workers reported", ["worker"], registry=r)
        self.prediction_error = Histogram("prefixlb_router_cached_tokens_prediction_error_tokens",
                                          "|predicted - reported| cached tokens per request",
                                          buckets=TOKEN_ERROR_BUCKETS, registry=r)
        self.upstream_errors = Counter("prefixlb_router_upstream_errors_total",
                                       "Failed attempts to a worker (before the first byte: retried) and failed streams, by "
                                       "kind (refused, connect, timeout, status, disconnected, draining, aborted, "
                                       "mid_stream, truncated)",
                                       ["worker", "kind"], registry=r)
        self.retries = Counter("prefixlb_router_retries_total", "Requests retried on another worker",
                               registry=r)
        self.client_disconnects = Counter("prefixlb_router_client_disconnects_total",
                                          "Requests whose client went away before the end", registry=r)
        self.kv_events = Counter("prefixlb_router_kv_events_total", "KV events applied, by kind",
                                 ["kind"], registry=r)
        self.kv_event_lag = Histogram("prefixlb_router_kv_event_lag_seconds",
                                      "Delay from a worker publishing a KV event to this router applying it",
                                      buckets=LAG_BUCKETS, registry=r)
        self.redis_errors = Counter("prefixlb_router_redis_errors_total",
                                    "Redis operations that failed, by task", ["task"], registry=r)
        self.overloaded = Counter("prefixlb_router_overload_rejections_total",
                                  "Requests refused with 429 by admission control, by reason "
                                  "(queue_full, queue_timeout)", ["reason"], registry=r)
        self.queue_wait = Histogram("prefixlb_router_queue_wait_seconds",
                                    "Time admitted requests waited in the overload queue",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.prewarm = Counter("prefixlb_router_prewarm_requests_total",
                               "Pre-warming requests sent to joining workers, by outcome", ["outcome"],
                               registry=r)
        self.resyncs = Counter("prefixlb_router_redis_resyncs_total",
                               "Resynchronisations with Redis after an outage, by what was found "
                               "(ok, trimmed, stream_lost, stream_reset, full)", ["kind"], registry=r)
        self.snapshots = Counter("prefixlb_router_index_snapshots_total",
                                 "Index snapshots, by operation (write, load)", ["op"], registry=r)
        self.cached_unreported = Counter("prefixlb_router_cached_tokens_unreported_total",
                                         "Answers whose usage had no prompt_tokens_details.cached_tokens: the "
                                         "router cannot correct its prefix index from them (vLLM needs "
                                         "--enable-prompt-tokens-details)", ["worker"], registry=r)
        self.messages_dropped = Counter("prefixlb_router_messages_dropped_total",
                                        "Messages from workers or Redis refused by their schema or bound to "
                                        "the wrong sender, by kind (registration, load_report, kv_event, "
                                        "snapshot; replay: a signed message older than one already seen "
                                        "from its worker)", ["kind"], registry=r)
        self.loop_errors = Counter("prefixlb_router_loop_errors_total",
                                   "Unexpected errors a background loop survived, by loop", ["task"], registry=r)
        self.ttfb = Histogram("prefixlb_router_time_to_first_byte_seconds",
                              "Arrival at the router to the worker's first bytes (streaming: the first token; "
                              "else the whole answer), by model", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("prefixlb_router_request_duration_seconds",
                                  "Arrival at the router to the end of the answer, by model (errors included)",
                                  ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self._feedback: dict[str, tuple] = {}
        self._unreported_logged: set[str] = set()
        self._requests: dict[tuple[str, str], Any] = {}
        # label children of the per-request families, looked up once (labels() costs a lock and
        # a tuple of strings per call); their keys are bounded: status codes, served models
        self._responses: dict[int, Any] = {}
        self._by_model: dict[str, tuple[Any, Any]] = {}

    def add_state(self, read: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        """Register a scrape-time reader of state gauges."""
        self.registry.register(_StateCollector(read))

    def render(self) -> bytes:
        """The exposition-format text of every metric."""
        return generate_latest(self.registry)

    def observe_feedback(self, worker_id: str, predicted: int, prompt_tokens: int, cached: int) -> None:
        """Record a finished request's predicted vs reported cached tokens."""
        children = self._feedback.get(worker_id)
        if children is None:
            children = self._feedback[worker_id] = (self.predicted_cached.labels(worker_id),
                                                    self.reported_cached.labels(worker_id),
                                                    self.prompt_tokens.labels(worker_id))
        children[0].inc(predicted)
        children[1].inc(cached)
        children[2].inc(prompt_tokens)
        self.prediction_error.observe(abs(predicted - cached))

    def count_unreported_cached(self, worker_id: str) -> bool:
        """Count an answer without ``cached_tokens``; True the first time for ``worker_id`` (log it)."""
        self.cached_unreported.labels(worker_id).inc()
        if worker_id in self._unreported_logged:
            return False
        self._unreported_logged.add(worker_id)
        return True

    def observe_request(self, model: str, ttfb_s: float | None, duration_s: float) -> None:
        """A finished request's time to first byte (None: no worker answered) and duration."""
        children = self._by_model.get(model)
        if children is None:
            children = self._by_model[model] = (self.ttfb.labels(model), self.duration.labels(model))
        if ttfb_s is not None:
            children[0].observe(ttfb_s)
        children[1].observe(duration_s)

    def count_response(self, status: int) -> None:
        """Count an answer sent to a client, by its status code."""
        child = self._responses.get(status)
        if child is None:
            child = self._responses[status] = self.responses.labels(str(status))
        child.inc()

    def count_request(self, worker_id: str, reason: str) -> None:
        """Count a routed request (label children cached: this runs for every request)."""
        child = self._requests.get((worker_id, reason))
        if child is None:
            child = self._requests[(worker_id, reason)] = self.requests.labels(worker_id, reason)
        child.inc()


def gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    """A scrape-time gauge family (for :meth:`RouterMetrics.add_state` readers)."""
    return GaugeMetricFamily(name, documentation, labels=labels)
