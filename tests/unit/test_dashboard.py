"""The Grafana dashboard and the Prometheus alert rules (deploy/): well-formed, and covering
what operators need. That every metric they query is one the code defines is checked against
live servers in tests/integration/test_observability_metrics.py.
"""
from __future__ import annotations

import json
import re

import yaml

from tests.deploy_support import (
    ALERTS_FILE, DASHBOARD_FILE, alert_exprs, dashboard_exprs, markdown_anchors, markdown_section,
    promql_matchers, promql_metric_names,
)
from tests.support import ROOT


def _panel(title: str) -> dict:
    [panel] = [p for p in json.loads(DASHBOARD_FILE.read_text())["panels"] if p["title"] == title]
    return panel


def test_promql_metric_names_are_the_selected_series_not_functions_labels_or_durations():
    expr = ('histogram_quantile(0.99, sum by (le, worker) (rate(a_seconds_bucket{job="x", code=~"5.."}'
            '[$__rate_interval]))) / on (worker) group_left max(b_total offset 1h) > 2 * avg(c) and up == 0'
            ' unless d:recorded:rate5m[5m:1m] > bool 1e3')
    assert promql_metric_names(expr) == {"a_seconds_bucket", "b_total", "c", "up", "d:recorded:rate5m"}


def test_dashboard_is_a_provisionable_grafana_dashboard():
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    assert (dashboard["uid"], dashboard["title"]) == ("prefixlb", "prefixlb")
    [variable] = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and panel["description"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    # No two panels overlap on the grid.
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))


def test_dashboard_shows_hit_rate_predictions_ttft_load_decisions_health_and_redis():
    used = set().union(*(promql_metric_names(e) for _, e in dashboard_exprs()))
    required = {
        "hit rate": {"prefixlb_router_reported_cached_tokens_total", "prefixlb_router_prompt_tokens_total",
                     "prefixlb_worker_prefix_cache_hit_tokens_total"},
        "predicted vs actual cached tokens": {"prefixlb_router_predicted_cached_tokens_total"},
        "TTFT": {"prefixlb_worker_time_to_first_token_seconds_bucket"},
        "requests and load per worker": {"prefixlb_router_requests_total", "prefixlb_router_worker_inflight_requests"},
        "decisions by reason": {"prefixlb_router_requests_total"},
        "breaker / health": {"prefixlb_router_worker_healthy", "prefixlb_router_workers"},
        "Redis and event lag": {"prefixlb_router_redis_up", "prefixlb_router_kv_event_lag_seconds_bucket"},
        "breaker opens": {"prefixlb_router_breaker_opens_total"},
        "overload (429s) and the admission queue": {"prefixlb_router_overload_rejections_total",
                                                    "prefixlb_router_queued_requests",
                                                    "prefixlb_router_inflight_requests",
                                                    "prefixlb_router_queue_wait_seconds_bucket"},
        "Redis resyncs": {"prefixlb_router_redis_resyncs_total"},
        "pre-warming": {"prefixlb_router_prewarm_requests_total"},
    }
    for what, metrics in required.items():
        assert metrics <= used, f"{what}: {sorted(metrics - used)}"
    reasons = [e for title, e in dashboard_exprs() if title == "Decisions by reason"]
    assert reasons == ["sum by (reason) (rate(prefixlb_router_requests_total[$__rate_interval]))"]


def test_workers_by_state_panel_names_every_state_the_router_has():
    from router.fleet.registry import STATES

    panel = _panel("Workers by state")
    assert [t["expr"] for t in panel["targets"]] == ["max by (state) (prefixlb_router_workers)"]
    coloured = {o["matcher"]["options"] for o in panel["fieldConfig"]["overrides"]}
    assert coloured == set(STATES)  # joining, warming, healthy, recovering, unhealthy, draining, drained
    for state in STATES:
        assert state in panel["description"], state


def test_workers_out_of_rotation_are_the_states_the_router_does_not_route_to():
    from router.fleet.registry import ROUTABLE

    [expr] = [t["expr"] for t in _panel("Workers out of rotation")["targets"]]
    [(metric, label, op, value)] = promql_matchers(expr)
    assert (metric, label, op) == ("prefixlb_router_workers", "state", "!~")
    assert set(value.split("|")) == set(ROUTABLE)


def test_alert_rules_are_complete_and_their_runbook_urls_are_headings_of_the_operations_guide():
    rules = [r for g in yaml.safe_load(ALERTS_FILE.read_text())["groups"] for r in g["rules"]]
    anchors = markdown_anchors((ROOT / "docs/operations.md").read_text())
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert re.fullmatch(r"Prefixlb[A-Za-z]+", rule["alert"])
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        # runbook_url: the annotation name Alertmanager templates and Grafana link to.
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, rule["alert"]
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "docs/operations.md" and anchor in anchors, rule["annotations"]["runbook_url"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_alerts_cover_hit_rate_collapse_worker_down_redis_unreachable_and_imbalance():
    exprs = dict(alert_exprs())
    assert {"PrefixlbHitRateCollapse", "PrefixlbWorkerDown", "PrefixlbRedisUnreachable",
            "PrefixlbImbalance"} <= set(exprs)
    assert "offset 1h" in exprs["PrefixlbHitRateCollapse"]
    assert promql_metric_names(exprs["PrefixlbHitRateCollapse"]) == {
        "prefixlb_router_reported_cached_tokens_total", "prefixlb_router_prompt_tokens_total"}
    assert promql_metric_names(exprs["PrefixlbRedisUnreachable"]) == {"prefixlb_router_redis_up"}
    assert 'job="prefixlb-worker"' in exprs["PrefixlbWorkerDown"]


def test_alerts_cover_sustained_overload_queueing_breaker_flapping_and_redis_flapping():
    exprs = dict(alert_exprs())
    assert promql_metric_names(exprs["PrefixlbOverloaded"]) == {
        "prefixlb_router_overload_rejections_total", "prefixlb_router_responses_total"}
    assert promql_metric_names(exprs["PrefixlbRequestsQueued"]) == {"prefixlb_router_queued_requests"}
    assert promql_metric_names(exprs["PrefixlbBreakerFlapping"]) == {"prefixlb_router_breaker_opens_total"}
    assert "by (worker)" in exprs["PrefixlbBreakerFlapping"]  # per worker, not the fleet's sum
    assert promql_metric_names(exprs["PrefixlbRedisFlapping"]) == {"prefixlb_router_redis_resyncs_total"}


def test_every_alert_is_explained_in_the_operations_guides_alert_table():
    guide = markdown_section((ROOT / "docs/operations.md").read_text(), "## 9. Observability")
    listed = set(re.findall(r"^\| `(Prefixlb[A-Za-z]+)` \|", guide, flags=re.M))
    assert listed == {name for name, _ in alert_exprs()}
