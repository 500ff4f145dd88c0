"""UsageLedger: running totals of tokens and money, per model and per tenant.

The router records every answer it forwards here (``router/cost/accounting.py``);
``GET /admin/usage`` serves :meth:`UsageLedger.snapshot` and the metrics read
:func:`router.cost.metrics.ledger_families`. A tenant is who pays: the client's API key (as a
digest, never the key itself) or its session key. The tenant table is bounded: beyond
``max_tenants`` distinct tenants, new ones are added up under :data:`OVERFLOW_TENANT`, so a
client inventing session ids cannot grow the router's memory.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Iterable

from router.cost.pricing import PricedUsage, Usage

OVERFLOW_TENANT = "_other"
UNKNOWN_TENANT = "_anonymous"
MAX_TENANT_CHARS = 128


@dataclass(slots=True)
class UsageTotals:
    """Sums over recorded responses. ``unpriced_requests`` had no price-book entry (their
    tokens count, their money does not)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    no_cache_cost_usd: float = 0.0
    unpriced_requests: int = 0

    def add_counts(self, prompt: int, completion: int, cached: int, written: int, priced: PricedUsage | None) -> None:
        """Count one response of these token counts (a :class:`Usage`'s)."""
        self.requests += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.cache_write_tokens += written
        self.completion_tokens += completion
        if priced is None:
            self.unpriced_requests += 1
        else:
            self.cost_usd += priced.total_usd
            self.no_cache_cost_usd += priced.no_cache_usd

    @classmethod
    def summed(cls, parts: Iterable["UsageTotals"]) -> "UsageTotals":
        """The totals of ``parts`` added up."""
        out = cls()
        for t in parts:
            for f in dataclasses.fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(t, f.name))
        return out

    @property
    def saved_usd(self) -> float:
        """What caching saved over these responses."""
        return self.no_cache_cost_usd - self.cost_usd

    def as_dict(self) -> dict:
        """JSON-ready totals (money rounded to 1e-9 USD)."""
        out = dataclasses.asdict(self)
        for key in ("cost_usd", "no_cache_cost_usd"):
            out[key] = round(out[key], 9)
        out["saved_usd"] = round(self.saved_usd, 9)
        return out


def tenant_of(api_key: str | None = None, session: str | None = None) -> str:
    """The tenant a request is billed to: ``key:<digest>`` of its API key, else its session
    key (truncated), else :data:`UNKNOWN_TENANT`. The key itself never leaves this function."""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    if session:
        return "session:" + session[:MAX_TENANT_CHARS]
    return UNKNOWN_TENANT


@dataclass(slots=True)
class UsageLedger:
    """Totals per model and per (tenant, model), kept as answers are recorded; overall and per
    tenant, added up from them when read."""

    max_tenants: int = 10_000
    models: dict[str, UsageTotals] = field(default_factory=dict)
    tenants: dict[str, dict[str, UsageTotals]] = field(default_factory=dict)
    overflowed_tenants: int = 0

    def record(self, model: str, tenant: str, usage: Usage, priced: PricedUsage | None) -> None:
        """Count one response of ``model`` billed to ``tenant`` (see :func:`tenant_of`)."""
        self.record_counts(model, tenant, (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                                           usage.cache_write_tokens), priced)

    def record_counts(self, model: str, tenant: str, counts: tuple[int, int, int, int],
                      priced: PricedUsage | None) -> None:
        """:meth:`record` of a usage's ``(prompt, completion, cached, written)`` counts
        (``router.cost.pricing.openai_counts``), without a :class:`Usage` built for them."""
        totals = self.models.get(model)  # get first: setdefault would build a UsageTotals every time
        if totals is None:
            totals = self.models[model] = UsageTotals()
        totals.add_counts(*counts, priced)
        per_model = self.tenants.get(tenant)
        if per_model is None:
            if len(self.tenants) >= self.max_tenants:
                self.overflowed_tenants += 1
                tenant = OVERFLOW_TENANT
            per_model = self.tenants.setdefault(tenant, {})
        totals = per_model.get(model)
        if totals is None:
            totals = per_model[model] = UsageTotals()
        totals.add_counts(*counts, priced)

    @property
    def total(self) -> UsageTotals:
        """The totals over every model (added up when read, not on every answer)."""
        return UsageTotals.summed(self.models.values())

    def tenant_total(self, tenant: str) -> UsageTotals:
        """One tenant's totals over all its models."""
        return UsageTotals.summed(self.tenants.get(tenant, {}).values())

    def snapshot(self) -> dict:
        """The body of ``GET /admin/usage``: totals overall, by model, and by tenant."""
        return {
            "total": self.total.as_dict(),
            "models": {m: t.as_dict() for m, t in sorted(self.models.items())},
            "tenants": {tenant: {"total": self.tenant_total(tenant).as_dict(),
                                 "models": {m: t.as_dict() for m, t in sorted(models.items())}}
                        for tenant, models in sorted(self.tenants.items())},
            "overflowed_tenants": self.overflowed_tenants,
        }
