"""UsageLedger: totals per model and per tenant, bounded, and what /admin/usage and /metrics show."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from router.cost.ledger import OVERFLOW_TENANT, UNKNOWN_TENANT, UsageLedger, tenant_of
from router.cost.metrics import ledger_families
from router.cost.price_book import HostedPrice
from router.cost.pricing import Usage, price_usage

PRICE = HostedPrice(input_per_mtok=1e6, output_per_mtok=2e6)  # 1 USD per input token, 2 per output token


def _record(ledger, model, tenant, usage, priced=True):
    ledger.record(model, tenant, usage, price_usage(usage, PRICE) if priced else None)


def test_totals_add_up_per_model_and_per_tenant():
    ledger = UsageLedger()
    _record(ledger, "small", "key:a", Usage(100, 10, 60))   # 40 + 6 + 20 = 66, no-cache 120
    _record(ledger, "large", "key:a", Usage(50, 5, 0))      # 50 + 10 = 60, no-cache 60
    _record(ledger, "small", "session:s", Usage(10, 1, 0), priced=False)
    snap = ledger.snapshot()
    assert snap["total"] == {"requests": 3, "prompt_tokens": 160, "cached_tokens": 60, "cache_write_tokens": 0,
                             "completion_tokens": 16, "cost_usd": 126.0, "no_cache_cost_usd": 180.0,
                             "unpriced_requests": 1, "saved_usd": 54.0}
    assert snap["models"]["small"]["requests"] == 2 and snap["models"]["small"]["cost_usd"] == 66.0
    assert snap["models"]["large"]["no_cache_cost_usd"] == 60.0
    a = snap["tenants"]["key:a"]
    assert a["total"]["cost_usd"] == 126.0 and a["total"]["requests"] == 2
    assert set(a["models"]) == {"small", "large"}
    assert snap["tenants"]["session:s"]["total"]["unpriced_requests"] == 1
    assert snap["overflowed_tenants"] == 0


def test_tenants_beyond_the_bound_are_added_up_as_one():
    ledger = UsageLedger(max_tenants=2)
    for tenant in ("t1", "t2", "t3", "t4", "t1"):
        _record(ledger, "m", tenant, Usage(1, 0, 0))
    assert sorted(ledger.tenants) == [OVERFLOW_TENANT, "t1", "t2"]
    assert ledger.tenant_total("t1").requests == 2
    assert ledger.tenant_total(OVERFLOW_TENANT).requests == 2
    assert ledger.overflowed_tenants == 2
    assert ledger.total.requests == 5


def test_the_tenant_of_an_api_key_is_a_digest_never_the_key():
    tenant = tenant_of(api_key="sk-secret-123", session="s1")
    assert tenant.startswith("key:") and "secret" not in tenant and len(tenant) == 4 + 16
    assert tenant == tenant_of(api_key="sk-secret-123")
    assert tenant_of(session="conv-7") == "session:conv-7"
    assert tenant_of(session="x" * 500) == "session:" + "x" * 128
    assert tenant_of() == UNKNOWN_TENANT


class _Read(Collector):
    def __init__(self, ledger):
        self.ledger = ledger

    def collect(self):
        return ledger_families(self.ledger)


def test_metrics_expose_cost_and_its_counterfactual_per_model():
    ledger = UsageLedger()
    _record(ledger, "small", "t", Usage(100, 10, 60))
    _record(ledger, "small", "t", Usage(5, 0, 0), priced=False)
    registry = CollectorRegistry()
    registry.register(_Read(ledger))
    text = generate_latest(registry).decode()
    assert 'prefixlb_router_cost_usd_total{kind="actual",model="small"} 66.0' in text
    assert 'prefixlb_router_cost_usd_total{kind="no_cache",model="small"} 120.0' in text
    assert 'prefixlb_router_usage_tokens_total{kind="cached",model="small"} 60.0' in text
    assert 'prefixlb_router_usage_requests_total{model="small",priced="false"} 1.0' in text
    assert "tenant" not in text


def test_saved_money_is_negative_when_writes_were_not_read_back():
    ledger = UsageLedger()
    _record(ledger, "m", "t", Usage(1_000, 0, 0, 1_000))  # a 1.25x write nobody read
    assert ledger.total.saved_usd == pytest.approx(-250.0)
