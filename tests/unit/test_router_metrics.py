"""The request path's metric updates (router/metrics.py) go through lock-free values: the
exposition must be exactly what prometheus_client's own ``inc`` / ``observe`` give."""
from __future__ import annotations

import math
import random
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.metrics import DECISION_BUCKETS, LATENCY_BUCKETS, TOKEN_ERROR_BUCKETS, RouterMetrics, observe


def _without_created(text: bytes) -> str:
    """The exposition less its ``_created`` timestamps (they differ between two registries)."""
    return re.sub(r"^\S+_created(\{[^}]*\})? \S+\n", "", text.decode(), flags=re.M)


def _reference(updates: list[tuple]) -> str:
    """The same updates applied by prometheus_client's own methods."""
    r = CollectorRegistry(auto_describe=True)
    requests = Counter("prefixlb_router_requests_total", "x", ["worker", "reason"], registry=r)
    responses = Counter("prefixlb_router_responses_total", "x", ["code"], registry=r)
    decision = Histogram("prefixlb_router_decision_seconds", "x", buckets=DECISION_BUCKETS, registry=r)
    predicted = Counter("prefixlb_router_predicted_cached_tokens_total", "x", ["worker"], registry=r)
    reported = Counter("prefixlb_router_reported_cached_tokens_total", "x", ["worker"], registry=r)
    prompt = Counter("prefixlb_router_prompt_tokens_total", "x", ["worker"], registry=r)
    error = Histogram("prefixlb_router_cached_tokens_prediction_error_tokens", "x", buckets=TOKEN_ERROR_BUCKETS,
                      registry=r)
    ttfb = Histogram("prefixlb_router_time_to_first_byte_seconds", "x", ["model"], buckets=LATENCY_BUCKETS, registry=r)
    duration = Histogram("prefixlb_router_request_duration_seconds", "x", ["model"], buckets=LATENCY_BUCKETS,
                         registry=r)
    for kind, *args in updates:
        if kind == "request":
            requests.labels(*args).inc()
        elif kind == "response":
            responses.labels(str(args[0])).inc()
        elif kind == "decision":
            decision.observe(args[0])
        elif kind == "feedback":
            worker, p, tokens, cached = args
            predicted.labels(worker).inc(p)
            reported.labels(worker).inc(cached)
            prompt.labels(worker).inc(tokens)
            error.observe(abs(p - cached))
        else:
            model, t, d = args
            if t is not None:
                ttfb.labels(model).observe(t)
            duration.labels(model).observe(d)
    return _without_created(generate_latest(r))


def _families(text: str, names: set[str]) -> str:
    """The lines of ``text`` about the metrics ``names`` (HELP lines left out: the texts differ)."""
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith("# HELP") and re.split(r"[ {]", line.removeprefix("# TYPE "))[0]
                     .removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                     in names)


def test_request_path_updates_expose_exactly_what_prometheus_client_gives_on_random_values() -> None:
    rng = random.Random(18)
    bounds = [*DECISION_BUCKETS, *LATENCY_BUCKETS, 0.0, math.inf]
    updates: list[tuple] = []
    for _ in range(3000):
        kind = rng.choice(["request", "response", "decision", "feedback", "request_time"])
        if kind == "request":
            updates.append((kind, rng.choice(["w1", "w2"]), rng.choice(["cache_hit", "load"])))
        elif kind == "response":
            updates.append((kind, rng.choice([200, 400, 429, 502])))
        elif kind == "decision":  # values on the bounds too: a bucket's bound is inclusive
            updates.append((kind, rng.choice(bounds) if rng.random() < 0.3 else rng.random() * 0.02))
        elif kind == "feedback":
            updates.append((kind, rng.choice(["w1", "w2"]), rng.randrange(0, 5000), rng.randrange(0, 9000),
                            rng.randrange(0, 5000)))
        else:
            updates.append((kind, rng.choice(["m1", "unknown"]), rng.choice([None, rng.random() * 3, 0.005]),
                            rng.choice(bounds) if rng.random() < 0.3 else rng.random() * 400))
    m = RouterMetrics()
    for kind, *args in updates:
        if kind == "request":
            m.count_request(*args)
        elif kind == "response":
            m.count_response(args[0])
        elif kind == "decision":
            observe(m.decision, args[0])
        elif kind == "feedback":
            m.observe_feedback(*args)
        else:
            m.observe_request(*args)
    names = {"prefixlb_router_requests", "prefixlb_router_responses", "prefixlb_router_decision_seconds",
             "prefixlb_router_predicted_cached_tokens", "prefixlb_router_reported_cached_tokens",
             "prefixlb_router_prompt_tokens", "prefixlb_router_cached_tokens_prediction_error_tokens",
             "prefixlb_router_time_to_first_byte_seconds", "prefixlb_router_request_duration_seconds"}
    ours = _families(_without_created(m.render()), names)
    assert ours == _families(_reference(updates), names)
    assert "prefixlb_router_requests_total{" in ours and "prefixlb_router_decision_seconds_bucket{" in ours


def test_a_nan_observation_adds_to_the_sum_and_no_bucket_as_prometheus_client() -> None:
    m = RouterMetrics()
    observe(m.decision, math.nan)
    reference = Histogram("h", "x", buckets=DECISION_BUCKETS, registry=CollectorRegistry())
    reference.observe(math.nan)
    assert [b.get() for b in m.decision_seconds._buckets] == [b.get() for b in reference._buckets] == [0.0] * 12
    assert math.isnan(m.decision_seconds._sum.get())


def test_a_negative_reported_count_is_refused_as_prometheus_client_refuses_it() -> None:
    m = RouterMetrics()
    with pytest.raises(ValueError, match="non-negative"):
        m.observe_feedback("w1", 3, 10, -1)
    text = m.render().decode()
    assert 'prefixlb_router_predicted_cached_tokens_total{worker="w1"} 3.0' in text
    assert 'prefixlb_router_reported_cached_tokens_total{worker="w1"} 0.0' in text
