"""Every metric the Grafana dashboard and the alert rules query is one the code exposes.

A real router and a real simulated worker (both with Redis, so the Redis-related metrics
exist) serve one request; their /metrics pages are parsed with prometheus_client's own parser.
A dashboard panel on a misspelled or renamed metric would be silently empty in production;
here it fails. The same holds for the metric names docs/operations.md and the README's "Deploy"
section tell operators to look at, and for the label matchers the queries use.
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.deploy_support import (
    PROMETHEUS_SYNTHETIC, alert_exprs, dashboard_exprs, doc_metric_names, exposed_label_values,
    exposed_metric_names, markdown_section, promql_matchers, promql_metric_names,
)
from tests.support import ROOT, free_port, processes, spawn, wait_for

# Labels Prometheus attaches to every scraped series (not defined by our code).
TARGET_LABELS = frozenset({"job", "instance"})
# The metrics of failure handling (issue 6) that operators watch: each must be on the dashboard
# or in an alert rule, and exposed.
FAILURE_METRICS = frozenset({
    "prefixlb_router_breaker_opens_total", "prefixlb_router_overload_rejections_total",
    "prefixlb_router_queued_requests", "prefixlb_router_inflight_requests",
    "prefixlb_router_queue_wait_seconds_bucket", "prefixlb_router_redis_resyncs_total",
    "prefixlb_router_prewarm_requests_total", "prefixlb_router_workers",
})


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
            # With a (small) CPU KV tier: its metrics exist only where there is one.
            procs.append(spawn(["worker", "--simulate", "--port", str(worker_port), "--time-scale", "100",
                                "--worker-id", "w0", "--redis", redis_server_url, "--redis-prefix", prefix,
                                "--cpu-kv-blocks", "64"],
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
            pages = {"router": _get(router + "/metrics"),
                     "worker": _get(f"http://127.0.0.1:{worker_port}/metrics")}
            yield {**{c: exposed_metric_names(page) for c, page in pages.items()},
                   "labels": {**exposed_label_values(pages["worker"]), **exposed_label_values(pages["router"])}}
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


def test_failure_handling_metrics_are_on_the_dashboard_or_in_alerts_and_exposed(exposed):
    used = set().union(*(promql_metric_names(e) for _, e in dashboard_exprs() + alert_exprs()))
    assert sorted(FAILURE_METRICS - used) == []
    assert sorted(FAILURE_METRICS - exposed["router"]) == []


def test_every_metric_the_operations_guide_and_the_readme_deploy_section_name_is_exposed(exposed):
    defined = exposed["router"] | exposed["worker"]
    text = (ROOT / "docs/operations.md").read_text() + markdown_section((ROOT / "README.md").read_text(), "## Deploy")
    named = doc_metric_names(text)
    assert len(named) > 20  # the guide's failure-mode table and hit-rate checklist name them
    # A histogram is named by its family (prefixlb_..._seconds); its series carry _bucket etc.
    assert sorted(n for n in named if n not in defined and n + "_bucket" not in defined) == []


def test_label_matchers_use_labels_the_metrics_carry(exposed):
    queries = dashboard_exprs() + alert_exprs()
    checked = 0
    for where, expr in queries:
        for metric, label, _, _ in promql_matchers(expr):
            seen = exposed["labels"].get(metric)
            if seen is None or label in TARGET_LABELS:
                continue  # no sample yet (no such event in this short run), or Prometheus's own label
            assert label in seen, f"{where}: {metric} has no label {label!r} (it has {sorted(seen)})"
            checked += 1
    assert checked >= 2


def test_worker_states_the_dashboard_alerts_and_guide_select_are_states_the_router_reports(exposed):
    """``prefixlb_router_workers`` has a sample for every state, so each state named must be one."""
    states = exposed["labels"]["prefixlb_router_workers"]["state"]
    assert {"healthy", "recovering", "warming", "drained", "unhealthy", "draining"} <= states
    text = (ROOT / "docs/operations.md").read_text()
    selected = [(where, value) for where, expr in dashboard_exprs() + alert_exprs() + [("operations.md", text)]
                for metric, label, _, value in promql_matchers(expr)
                if (metric, label) == ("prefixlb_router_workers", "state")]
    assert len(selected) >= 3
    for where, value in selected:
        assert set(value.split("|")) <= states, (where, value)


def test_exposed_metrics_follow_prometheus_naming_conventions(exposed):
    for component in ("router", "worker"):
        names = exposed[component]
        ours = {n for n in names if n.startswith("prefixlb_")}
        assert ours and all(n.startswith(f"prefixlb_{component}_") for n in ours), component
        # A counter's series ends in _total; nothing else may pretend to be one.
        assert not [n for n in ours if n.endswith("_total_total")]
