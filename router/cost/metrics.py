"""The ledger as Prometheus metric families, read at scrape time.

Per model only: a per-tenant label would give the time-series database one series per API key
or session, which is what ``GET /admin/usage`` is for. Register with
``RouterMetrics.add_state(lambda: ledger_families(ledger))``.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from router.cost.ledger import UsageLedger


def ledger_families(ledger: UsageLedger) -> list[CounterMetricFamily]:
    """``prefixlb_router_cost_usd_total{model,kind}`` (kind: actual | no_cache) and the token
    counters behind it, ``prefixlb_router_usage_tokens_total{model,kind}`` (kind: prompt |
    cached | cache_write | completion), ``prefixlb_router_usage_requests_total{model,priced}``."""
    cost = CounterMetricFamily("prefixlb_router_cost_usd",
                               "Cost of the responses, and their no-cache counterfactual, in USD",
                               labels=["model", "kind"])
    tokens = CounterMetricFamily("prefixlb_router_usage_tokens", "Tokens of the priced responses",
                                 labels=["model", "kind"])
    requests = CounterMetricFamily("prefixlb_router_usage_requests",
                                   "Responses recorded, by whether the price book lists their model",
                                   labels=["model", "priced"])
    for model, t in sorted(ledger.models.items()):
        cost.add_metric([model, "actual"], t.cost_usd)
        cost.add_metric([model, "no_cache"], t.no_cache_cost_usd)
        for kind, value in (("prompt", t.prompt_tokens), ("cached", t.cached_tokens),
                            ("cache_write", t.cache_write_tokens), ("completion", t.completion_tokens)):
            tokens.add_metric([model, kind], value)
        requests.add_metric([model, "true"], t.requests - t.unpriced_requests)
        requests.add_metric([model, "false"], t.unpriced_requests)
    return [cost, tokens, requests]
