"""RouterMetrics: the router's Prometheus metrics (``GET /metrics``), one registry per app.

Names follow Prometheus conventions: ``prefixlb_router_`` prefix, ``_total`` counters, base
units in the name (``_seconds``, ``_tokens``). Gauges that describe state (index size, worker
health) are read at scrape time by a collector, never updated on the request path.

The counters and histograms a request updates (13 increments) hold their numbers in a
:class:`PlainValue`, prometheus_client's value without its lock, and are updated through it
directly (:func:`add`, :func:`observe`): they are only ever updated on the event loop's thread,
so the lock bought nothing, and the updates cost 12 -> 4 us a request. Their exposition is
prometheus_client's, unchanged.
"""
from __future__ import annotations

from bisect import bisect_left
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


class PlainValue:
    """prometheus_client's ``MutexValue`` (a metric child's number) without the lock: for the
    children updated on the request path, which only the event loop's thread touches."""

    __slots__ = ("_value", "_exemplar")
    _multiprocess = False

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


def plain_counter(child: Counter) -> PlainValue:
    """The value of a new (zero) counter child, now a :class:`PlainValue`: :func:`add` to it."""
    value = child._value = PlainValue()  # type: ignore[attr-defined]
    return value


def add(value: PlainValue, amount: float) -> None:
    """``Counter.inc(amount)`` of the child whose :func:`plain_counter` ``value`` is (its check too)."""
    if amount < 0:
        raise ValueError('Counters can only be incremented by non-negative amounts.')
    value._value += amount


PlainHistogram = tuple  # (sum, upper bounds, buckets): a histogram child's PlainValues


def plain_histogram(child: Histogram) -> PlainHistogram:
    """The values of a new (zero) histogram child, now :class:`PlainValue`: :func:`observe` them."""
    child._sum = PlainValue()  # type: ignore[attr-defined]
    child._buckets = [PlainValue() for _ in child._upper_bounds]  # type: ignore[attr-defined]
    return child._sum, tuple(child._upper_bounds), child._buckets  # type: ignore[attr-defined]


def observe(values: PlainHistogram, amount: float) -> None:
    """``Histogram.observe(amount)`` of the child whose :func:`plain_histogram` ``values`` are:
    the sum, and the first bucket whose bound is at least ``amount`` (none for a NaN, as there)."""
    total, bounds, buckets = values
    total._value += amount
    if amount == amount:
        buckets[bisect_left(bounds, amount)]._value += 1


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
        # label children of the per-request families, looked up once (labels() costs a lock and
        # a tuple of strings per call) and updated through their PlainValues; their keys are
        # bounded: workers and reasons, status codes, served models
        self._requests: dict[tuple[str, str], PlainValue] = {}
        self._responses: dict[int, PlainValue] = {}
        self._by_model: dict[str, tuple[PlainHistogram, PlainHistogram]] = {}
        self.decision = plain_histogram(self.decision_seconds)
        self._prediction_error = plain_histogram(self.prediction_error)

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
            children = self._feedback[worker_id] = (plain_counter(self.predicted_cached.labels(worker_id)),
                                                    plain_counter(self.reported_cached.labels(worker_id)),
                                                    plain_counter(self.prompt_tokens.labels(worker_id)))
        add(children[0], predicted)
        add(children[1], cached)
        add(children[2], prompt_tokens)
        observe(self._prediction_error, abs(predicted - cached))

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
            children = self._by_model[model] = (plain_histogram(self.ttfb.labels(model)),
                                                plain_histogram(self.duration.labels(model)))
        if ttfb_s is not None:
            observe(children[0], ttfb_s)
        observe(children[1], duration_s)

    def count_response(self, status: int) -> None:
        """Count an answer sent to a client, by its status code."""
        value = self._responses.get(status)
        if value is None:
            value = self._responses[status] = plain_counter(self.responses.labels(str(status)))
        value._value += 1

    def count_request(self, worker_id: str, reason: str) -> None:
        """Count a routed request (label children cached: this runs for every request)."""
        value = self._requests.get((worker_id, reason))
        if value is None:
            value = self._requests[(worker_id, reason)] = plain_counter(self.requests.labels(worker_id, reason))
        value._value += 1


def gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    """A scrape-time gauge family (for :meth:`RouterMetrics.add_state` readers)."""
    return GaugeMetricFamily(name, documentation, labels=labels)
