"""Every metric the Grafana dashboard and the alert rules query is one the code exposes.

A real router and a real simulated worker (both with Redis, so the Redis-related metrics
exist) serve one request; their /metrics pages are parsed with prometheus_client's own parser.
A dashboard panel on a misspelled or renamed metric would be silently empty in production;
here it fails.
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.deploy_support import (
    PROMETHEUS_SYNTHETIC, alert_exprs, dashboard_exprs, exposed_metric_names, promql_metric_names,
)
from tests.support import free_port, processes, spawn, wait_for


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def exposed(tmp_path_factory, redis_server_url) -> dict[str, set[str]]:
    import uuid

    import redis

    prefix = f"prefixlb-test-{uuid.uuid4().hex[:10]}:"
    logs = tmp_path_factory.mktemp("observability")
    worker_port, router_port = free_port(), free_port()
    try:
        with processes() as procs:
            procs.append(spawn(["worker", "--simulate", "--port", str(worker_port), "--time-scale", "100",
                                "--worker-id", "w0", "--redis", redis_server_url, "--redis-prefix", prefix],
                               logs, "worker", worker_port, timeout=90))
            procs.append(spawn(["router", "--port", str(router_port), "--redis", redis_server_url,
                                "--redis-prefix", prefix, "--worker", f"http://127.0.0.1:{worker_port}"],
                               logs, "router", router_port, timeout=60))
            router = f"http://127.0.0.1:{router_port}"
            model = json.loads(_get(f"http://127.0.0.1:{worker_port}/v1/models"))["data"][0]["id"]

            def completed() -> bool:
                body = json.dumps({"model": model, "prompt": "observability " * 40, "max_tokens": 2}).encode()
                req = urllib.request.Request(router + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status == 200

            wait_for(completed, 30, interval=0.2, what="a completion through the router")
            yield {"router": exposed_metric_names(_get(router + "/metrics")),
                   "worker": exposed_metric_names(_get(f"http://127.0.0.1:{worker_port}/metrics"))}
    finally:
        client = redis.Redis.from_url(redis_server_url)
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _undefined(exprs: list[tuple[str, str]], defined: set[str]) -> dict[str, list[str]]:
    missing = {}
    for where, expr in exprs:
        names = promql_metric_names(expr) - defined - PROMETHEUS_SYNTHETIC
        if names:
            missing[where] = sorted(names)
    return missing


def test_every_metric_the_dashboard_queries_is_exposed_by_the_router_or_the_worker(exposed):
    defined = exposed["router"] | exposed["worker"]
    assert _undefined(dashboard_exprs(), defined) == {}


def test_every_metric_the_alert_rules_query_is_exposed_by_the_router_or_the_worker(exposed):
    defined = exposed["router"] | exposed["worker"]
    assert _undefined(alert_exprs(), defined) == {}


def test_exposed_metrics_follow_prometheus_naming_conventions(exposed):
    for component, names in exposed.items():
        ours = {n for n in names if n.startswith("prefixlb_")}
        assert ours and all(n.startswith(f"prefixlb_{component}_") for n in ours), component
        # A counter's series ends in _total; nothing else may pretend to be one.
        assert not [n for n in ours if n.endswith("_total_total")]
