"""``prefixlb cost``: what prefix caching saves on a trace or a run, priced with price books.

``ttl_cache`` replays a hosted API's TTL cache over a workload, ``analysis`` prices it per
price-book model, ``report`` writes ``report.md`` and ``summary.json``.
"""
