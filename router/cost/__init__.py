"""Cost accounting: a price book, the price of one response's usage, and accumulators.

``price_book`` reads and validates the YAML price book; ``pricing`` turns one response's usage
into money beside its no-cache counterfactual and holds the break-even arithmetic; ``ledger``
accumulates per model and per tenant (what ``GET /admin/usage`` and the metrics show).
Pure: no I/O beyond reading the price book file.
"""
