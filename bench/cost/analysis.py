"""What caching saves on a workload or a run, for each price-book model: the numbers of
``prefixlb cost``'s report (``summary.json``).

For a hosted model and each TTL (5 minutes, 1 hour): the bill with the cache replayed
(:mod:`bench.cost.ttl_cache`) against the bill without it, the break-even read count, the
reuse count of every write (its reads within the TTL), and the writes that did not pay — the
prefixes whose reads stayed at or below break-even, with the money they lost. For a
self-hosted model: the prefill GPU time an ideal cache (no TTL, no capacity limit) saves,
and, for a run directory, what the fleet's measured ``cached_tokens`` saved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from bench.cost.ttl_cache import CacheReplay, Episode, replay_ttl_cache
from bench.records import RequestRecord
from bench.workloads.base import RequestSpec
from router.cost.price_book import HostedPrice, PriceBook, SelfHostedPrice
from router.cost.pricing import (PricedUsage, Usage, assume_full_prompt_writes, break_even_reads,
                                 min_paying_reads, price_usage)

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
REUSE_BUCKETS = ((0, 0), (1, 1), (2, 4), (5, 9), (10, 99), (100, None))
TOP_PREFIXES = 10


@dataclass(frozen=True, slots=True)
class PricedEntry:
    """One model of one price book."""

    book: str
    model: str
    price: HostedPrice | SelfHostedPrice


def entries(books: Sequence[PriceBook]) -> list[PricedEntry]:
    """Every (book, model) pair, in book order."""
    return [PricedEntry(b.name, m, p) for b in books for m, p in b.models.items()]


def _bucket_label(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"{lo}+"
    return str(lo) if lo == hi else f"{lo}-{hi}"


def reuse_histogram(episodes: Sequence[Episode]) -> dict[str, int]:
    """How many writes were read 0, 1, 2-4, 5-9, 10-99, 100+ times within their TTL."""
    out = {_bucket_label(lo, hi): 0 for lo, hi in REUSE_BUCKETS}
    for ep in episodes:
        for lo, hi in REUSE_BUCKETS:
            if ep.reads >= lo and (hi is None or ep.reads <= hi):
                out[_bucket_label(lo, hi)] += 1
                break
    return out


def _totals(priced: Iterable[PricedUsage]) -> dict:
    cost = no_cache = 0.0
    for p in priced:
        cost += p.total_usd
        no_cache += p.no_cache_usd
    return {"no_cache_usd": no_cache, "cost_usd": cost, "saved_usd": no_cache - cost,
            "saved_fraction": (no_cache - cost) / no_cache if no_cache else 0.0}


def _bill(replay: CacheReplay, price: HostedPrice, ttl: str) -> dict:
    return _totals(price_usage(Usage(u.prompt_tokens, u.completion_tokens, u.read_tokens, u.write_tokens, ttl),
                               price) for u in replay.uses)


def _prefix_table(replay: CacheReplay, price: HostedPrice, ttl: str) -> tuple[dict, list[dict], list[dict]]:
    """Unpaid writes and the per-prefix net savings (write premium vs read discount)."""
    w, r = price.write_multiplier(ttl), price.cache_read_multiplier
    need = min_paying_reads(w, r)
    token_usd = price.input_per_mtok / 1e6 * replay.block_tokens
    per_prefix: dict[int, dict] = {}
    unpaid = {"writes": 0, "censored": 0, "tokens": 0, "loss_usd": 0.0}
    for ep in replay.episodes:
        net = token_usd * ((1 + ep.reads) - (w + r * ep.reads))  # saved by this write vs no cache
        row = per_prefix.setdefault(ep.block, {"block": ep.block, "depth": ep.depth,
                                               "prefix_tokens": ep.depth * replay.block_tokens,
                                               "writes": 0, "reads": 0, "net_saved_usd": 0.0})
        row["writes"] += 1
        row["reads"] += ep.reads
        row["net_saved_usd"] += net
        if need is None or ep.reads < need:
            unpaid["writes"] += 1
            unpaid["censored"] += int(ep.censored)
            unpaid["tokens"] += replay.block_tokens
            unpaid["loss_usd"] += max(0.0, -net)
    rows = sorted(per_prefix.values(), key=lambda x: (x["net_saved_usd"], x["depth"]))
    losing = [x for x in rows if x["net_saved_usd"] < 0][:TOP_PREFIXES]
    saving = [x for x in reversed(rows) if x["net_saved_usd"] > 0][:TOP_PREFIXES]
    return unpaid, losing, saving


def break_even(price: HostedPrice, ttl: str) -> dict:
    """The break-even of writing a prefix with ``ttl``: ``break_even_reads`` (None: never pays;
    <= 0: any use pays) and the fewest paying reads (JSON-safe: no infinities)."""
    w, r = price.write_multiplier(ttl), price.cache_read_multiplier
    threshold = break_even_reads(w, r)
    if math.isinf(threshold):
        threshold = None if threshold > 0 else -1.0
    return {"write_multiplier": w, "read_multiplier": r, "break_even_reads": threshold,
            "min_paying_reads": min_paying_reads(w, r)}


def hosted_ttl(requests: Sequence[RequestSpec], price: HostedPrice, ttl: str, block_tokens: int,
               replays: dict[tuple[str, int], CacheReplay]) -> dict:
    """The report's numbers for one hosted model and one TTL (replays are shared by models
    with the same minimum)."""
    key = (ttl, price.min_cacheable_tokens)
    if key not in replays:
        replays[key] = replay_ttl_cache(requests, TTL_SECONDS[ttl], block_tokens, price.min_cacheable_tokens)
    replay = replays[key]
    unpaid, losing, saving = _prefix_table(replay, price, ttl)
    writes = len(replay.episodes)
    return {
        **_bill(replay, price, ttl),
        **break_even(price, ttl),
        "read_tokens": replay.read_tokens,
        "write_tokens": replay.write_tokens,
        "writes": writes,
        "reads_per_write": (sum(e.reads for e in replay.episodes) / writes) if writes else 0.0,
        "reuse_histogram": reuse_histogram(replay.episodes),
        "unpaid_writes": unpaid,
        "top_losing_prefixes": losing,
        "top_saving_prefixes": saving,
    }


def self_hosted_ideal(requests: Sequence[RequestSpec], price: SelfHostedPrice, block_tokens: int) -> dict:
    """Prefill GPU time and money an ideal cache saves on a self-hosted model."""
    replay = replay_ttl_cache(requests, None, block_tokens, 0)
    return _self_hosted_bill([Usage(u.prompt_tokens, u.completion_tokens, u.read_tokens) for u in replay.uses],
                             price)


def _self_hosted_bill(usages: Sequence[Usage], price: SelfHostedPrice) -> dict:
    out = _totals(price_usage(u, price) for u in usages)
    rate = price.usd_per_second
    out["saved_gpu_seconds"] = out["saved_usd"] / rate * price.gpus if rate else 0.0
    out["cached_tokens"] = sum(u.cached_tokens for u in usages)
    return out


def measured(records: Sequence[RequestRecord], entry: PricedEntry) -> dict:
    """What the fleet's reported ``cached_tokens`` saved under ``entry``'s price.

    Hosted prices assume every uncached prompt token was written with the 5-minute TTL: the
    run's workers report reads, not writes, so the write premium is an upper bound.
    """
    usages = [Usage(r.prompt_tokens, r.completion_tokens, min(r.cached_tokens, r.prompt_tokens))
              for r in records if r.ok]
    if isinstance(entry.price, SelfHostedPrice):
        return _self_hosted_bill(usages, entry.price)
    out = _totals(price_usage(assume_full_prompt_writes(u, entry.price, "5m"), entry.price) for u in usages)
    out["cached_tokens"] = sum(u.cached_tokens for u in usages)
    return out


def what_if_cached_share(requests: Sequence[RequestSpec], price: HostedPrice,
                         shares: Sequence[float] = (0.25, 0.5, 0.75)) -> list[dict]:
    """Without prefix information: the input saving if a share ``h`` of prompt tokens were
    cache reads, writes ignored (an upper bound): ``h · (1 − r)`` of the input bill."""
    input_usd = sum(r.prompt_tokens for r in requests) * price.input_per_mtok / 1e6
    total = input_usd + sum(r.max_tokens for r in requests) * price.output_per_mtok / 1e6
    rows = []
    for h in shares:
        saved = input_usd * h * (1.0 - price.cache_read_multiplier)
        rows.append({"cached_share": h, "saved_usd": saved, "saved_fraction": saved / total if total else 0.0})
    return rows
