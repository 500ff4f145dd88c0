"""CostAccounting: the router's price book and ledger, fed by every answered request.

The HTTP edge calls :meth:`CostAccounting.record` once per upstream answer that carried a
``usage`` (plain requests, every stage of a cascade, an LLM judge's own call), with the real
model that answered and the tenant it is billed to. The usage is priced with the book (cached
tokens at the read price, the no-cache counterfactual beside it); a model the book does not
list still counts its tokens. ``GET /admin/usage`` serves :meth:`snapshot`, ``/metrics`` the
ledger's families.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.cost.ledger import UsageLedger
from router.cost.metrics import ledger_families
from router.cost.price_book import PriceBook
from router.cost.pricing import PricedUsage, Usage, openai_counts, price_usage


class CostAccounting:
    """A price book (None: tokens only) and the ledger the router's answers are recorded in."""

    def __init__(self, price_book: PriceBook | None = None, ledger: UsageLedger | None = None) -> None:
        self.price_book = price_book
        self.ledger = ledger if ledger is not None else UsageLedger()

    def price(self, model: str, usage: Usage) -> PricedUsage | None:
        """``usage`` of ``model`` in USD, or None when the book does not list the model."""
        price = self.price_book.get(model) if self.price_book is not None else None
        return price_usage(usage, price) if price is not None else None

    def record(self, model: str, tenant: str, usage: Mapping[str, Any] | None) -> PricedUsage | None:
        """Price and count one answer's OpenAI ``usage`` (nothing when there is none)."""
        if type(usage) is not dict and not isinstance(usage, Mapping):  # (a dict: no ABC check)
            return None
        counts = openai_counts(usage)  # (a Usage built only when there is a price book)
        priced = self.price(model, Usage(*counts)) if self.price_book is not None else None
        self.ledger.record_counts(model, tenant, counts, priced)
        return priced

    def snapshot(self) -> dict[str, Any]:
        """The body of ``GET /admin/usage``."""
        return {"price_book": self.price_book.name if self.price_book is not None else None,
                **self.ledger.snapshot()}

    def families(self) -> list:
        """The ledger's metric families (a ``RouterMetrics.add_state`` reader)."""
        return ledger_families(self.ledger)
