"""``prefixlb cost``'s report: the source texts' caching walkthrough, run on your traffic.

Sources and what each allows:

- a **Mooncake trace** (``hash_ids`` per 512-token block, timestamps): everything — savings per
  TTL, reuse counts per write, break-even, the prefixes whose writes did not pay;
- an **Azure trace** (timestamps and token counts only): no prefix information, so no reuse,
  no per-prefix break-even, no unpaid writes; only the bill without caching, the break-even
  thresholds of each price, and a what-if table of savings for assumed cached shares;
- a **run directory** of ``prefixlb bench`` (``requests.jsonl`` + ``meta.json``): what the
  fleet's measured ``cached_tokens`` saved under each price, plus the full TTL analysis when the
  run's workload can be regenerated (its trace file still exists, or it is a generated one);
- a generated **workload** by name (``doc-qa``, ``system-prompt``, ``multi-turn``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from bench.cost.analysis import (TTL_SECONDS, PricedEntry, break_even, entries, hosted_ttl, measured,
                                 self_hosted_ideal, what_if_cached_share)
from bench.cost.ttl_cache import CacheReplay
from bench.records import RequestRecord, read_jsonl
from bench.workloads import WorkloadError, load_workload
from bench.workloads.base import RequestSpec, Workload
from router.cost.price_book import PriceBook, SelfHostedPrice


class CostSourceError(ValueError):
    """The trace, run directory or workload cannot be analysed."""


def workload_of(source: str) -> Workload:
    """The workload of a trace file (``.jsonl``: Mooncake, ``.csv``: Azure) or a workload spec."""
    path = Path(source)
    if path.is_file():
        kind = {".jsonl": "mooncake", ".csv": "azure"}.get(path.suffix.lower())
        if kind is None:
            raise CostSourceError(f"{source}: unknown trace format (.jsonl = Mooncake, .csv = Azure)")
        source = f"{kind}:{path}"
    try:
        return load_workload(source)
    except WorkloadError as exc:
        raise CostSourceError(str(exc)) from None


def run_workload(run_dir: Path) -> tuple[Workload | None, str | None]:
    """The workload a run replayed, regenerated from its ``meta.json`` (None + why not)."""
    meta_path = run_dir / "meta.json"
    if not meta_path.exists():
        return None, "no meta.json: the run's prompts cannot be regenerated"
    try:
        cfg = json.loads(meta_path.read_text()).get("config") or {}
        return load_workload(cfg["workload"], int(cfg.get("seed", 0)), cfg.get("num_requests"),
                             cfg.get("workload_opt") or None), None
    except (KeyError, TypeError, ValueError, WorkloadError, json.JSONDecodeError) as exc:
        return None, f"the run's workload cannot be regenerated ({exc})"


def has_prefix_information(workload: Workload) -> bool:
    """False for Azure traces: their prompts are distinct placeholders, not observed prefixes."""
    return not workload.name.startswith("azure:")


def _model_report(requests: Sequence[RequestSpec], entry: PricedEntry, prefix_info: bool, block_tokens: int,
                  replays: dict[tuple[str, int], CacheReplay]) -> dict:
    row: dict = {"book": entry.book, "model": entry.model}
    if isinstance(entry.price, SelfHostedPrice):
        row["kind"] = "self_hosted"
        if prefix_info:
            row["ideal_cache"] = self_hosted_ideal(requests, entry.price, block_tokens)
        return row
    row["kind"] = "hosted"
    if prefix_info:
        row["ttl"] = {ttl: hosted_ttl(requests, entry.price, ttl, block_tokens, replays) for ttl in TTL_SECONDS}
    else:
        row["ttl"] = {ttl: break_even(entry.price, ttl) for ttl in TTL_SECONDS}
        row["what_if"] = what_if_cached_share(requests, entry.price)
    return row


def cost_summary(books: Sequence[PriceBook], *, workload: Workload | None = None,
                 records: Sequence[RequestRecord] | None = None, block_tokens: int = 512,
                 source: dict | None = None, notes: Sequence[str] = ()) -> dict:
    """The ``summary.json`` of a cost report (see the module docstring)."""
    if workload is None and records is None:
        raise CostSourceError("nothing to analyse: give a workload or run records")
    prefix_info = workload is not None and has_prefix_information(workload)
    notes = list(notes)
    requests: list[RequestSpec] = list(workload.requests) if workload is not None else []
    if records is not None and workload is not None:
        sent = {r.index for r in records}
        requests = [r for r in requests if r.index in sent]
    if workload is not None and not prefix_info:
        notes.append("no prefix information in this trace: reuse counts, per-prefix break-even and unpaid "
                     "writes cannot be computed; the what-if table assumes a cached share instead")
    replays: dict[tuple[str, int], CacheReplay] = {}
    models = []
    for entry in entries(books):
        row = _model_report(requests, entry, prefix_info, block_tokens, replays) if requests else \
            {"book": entry.book, "model": entry.model,
             "kind": "self_hosted" if isinstance(entry.price, SelfHostedPrice) else "hosted"}
        if records is not None:
            row["measured"] = measured(records, entry)
        models.append(row)
    return {
        "source": source or {},
        "requests": len(requests) if requests else len(records or []),
        "prompt_tokens": sum(r.prompt_tokens for r in requests),
        "completion_tokens": sum(r.max_tokens for r in requests),
        "block_tokens": block_tokens,
        "prefix_information": prefix_info,
        "trace_seconds": max((r.arrival_s for r in requests), default=0.0),
        "notes": notes,
        "models": models,
    }


def _usd(x: float) -> str:
    return f"{x:,.4f}" if abs(x) < 100 else f"{x:,.2f}"


def _reads(x: float | None) -> str:
    return "never" if x is None else f"{x:.4f}"


def _per_ttl(models: Sequence[dict]):
    """(model row, TTL, its numbers) for every hosted model and TTL."""
    return ((m, ttl, t) for m in models for ttl, t in m["ttl"].items())


def render_markdown(summary: dict) -> str:
    """``report.md`` for a summary."""
    src = summary["source"]
    lines = [f"# Prefix-caching cost report: {src.get('name', 'workload')}", "",
             f"{summary['requests']:,} requests, {summary['prompt_tokens']:,} prompt tokens, "
             f"{summary['completion_tokens']:,} completion tokens over {summary['trace_seconds']:.0f} s; "
             f"cache blocks of {summary['block_tokens']} tokens.", ""]
    lines += [f"- {n}" for n in summary["notes"]]
    if summary["notes"]:
        lines.append("")
    hosted = [m for m in summary["models"] if m["kind"] == "hosted"]
    lines += ["## Break-even", "",
              "A prefix written once (w × the input price) and read k times (r × each) costs "
              "w + r·k against 1 + k without the cache: it pays when k > (w − 1)/(1 − r).", "",
              "| book | model | TTL | write × | read × | pays above k reads | fewest paying reads |",
              "|---|---|---|---|---|---|---|"]
    for m, ttl, t in _per_ttl(hosted):
        fewest = "never" if t["min_paying_reads"] is None else t["min_paying_reads"]
        lines.append(f"| {m['book']} | {m['model']} | {ttl} | {t['write_multiplier']:g} | {t['read_multiplier']:g} | "
                     f"{_reads(t['break_even_reads'])} | {fewest} |")
    lines.append("")
    if summary["prefix_information"]:
        lines += ["## Savings from caching (hosted, cache replayed with each TTL)", "",
                  "| book | model | TTL | no cache (USD) | with cache (USD) | saved (USD) | saved | read tokens | "
                  "written tokens | reads per write |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {m['book']} | {m['model']} | {ttl} | {_usd(t['no_cache_usd'])} | {_usd(t['cost_usd'])} | "
                  f"{_usd(t['saved_usd'])} | {t['saved_fraction']:.1%} | {t['read_tokens']:,} | "
                  f"{t['write_tokens']:,} | {t['reads_per_write']:.2f} |" for m, ttl, t in _per_ttl(hosted)]
        lines += ["", "## Reuse of each write within its TTL", "",
                  "How many times each written prefix was read before it expired.", ""]
        lines += [f"- {m['book']} / {m['model']} / {ttl}: {t['writes']:,} writes; reads "
                  + ", ".join(f"{k}: {v:,}" for k, v in t["reuse_histogram"].items()) for m, ttl, t in _per_ttl(hosted)]
        lines += ["", "## Writes that did not pay", "",
                  "A write pays when its reads exceed the break-even count; below it the write premium was lost "
                  "(censored = still alive when the trace ended, so it might have paid later).", "",
                  "| book | model | TTL | unpaid writes | of all writes | censored | tokens | lost (USD) |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, ttl, t in _per_ttl(hosted):
            u = t["unpaid_writes"]
            share = u["writes"] / t["writes"] if t["writes"] else 0.0
            lines.append(f"| {m['book']} | {m['model']} | {ttl} | {u['writes']:,} | {share:.1%} | {u['censored']:,} | "
                         f"{u['tokens']:,} | {_usd(u['loss_usd'])} |")
        for m in hosted:
            losing = m["ttl"]["5m"]["top_losing_prefixes"]
            if losing:
                lines += ["", f"Prefixes that lost most ({m['book']} / {m['model']} / 5m):", "",
                          "| prefix (block hash) | prefix tokens | writes | reads | net saved (USD) |", "|---|---|---|---|---|"]
                lines += [f"| {p['block']:016x} | {p['prefix_tokens']:,} | {p['writes']} | {p['reads']} | "
                          f"{_usd(p['net_saved_usd'])} |" for p in losing]
    else:
        lines += ["## What-if (no prefix information)", "",
                  "| book | model | cached share of input | saved (USD) | of the bill |", "|---|---|---|---|---|"]
        for m in hosted:
            lines += [f"| {m['book']} | {m['model']} | {w['cached_share']:.0%} | {_usd(w['saved_usd'])} | "
                      f"{w['saved_fraction']:.1%} |" for w in m["what_if"]]
    self_hosted = [m for m in summary["models"] if m["kind"] == "self_hosted" and "ideal_cache" in m]
    if self_hosted:
        lines += ["", "## Self-hosted: prefill an ideal cache saves (no TTL, unbounded capacity)", "",
                  "| book | model | no cache (USD) | with cache (USD) | saved | GPU-seconds saved |", "|---|---|---|---|---|---|"]
        lines += [f"| {m['book']} | {m['model']} | {_usd(m['ideal_cache']['no_cache_usd'])} | "
                  f"{_usd(m['ideal_cache']['cost_usd'])} | {m['ideal_cache']['saved_fraction']:.1%} | "
                  f"{m['ideal_cache']['saved_gpu_seconds']:,.1f} |" for m in self_hosted]
    with_measured = [m for m in summary["models"] if "measured" in m]
    if with_measured:
        lines += ["", "## Measured on the run (the workers' reported cached tokens)", "",
                  "Hosted rows assume every uncached prompt token was written (5-minute TTL): an upper bound "
                  "of the write premium.", "",
                  "| book | model | cached tokens | no cache (USD) | with cache (USD) | saved |", "|---|---|---|---|---|---|"]
        lines += [f"| {m['book']} | {m['model']} | {m['measured']['cached_tokens']:,} | "
                  f"{_usd(m['measured']['no_cache_usd'])} | {_usd(m['measured']['cost_usd'])} | "
                  f"{m['measured']['saved_fraction']:.1%} |" for m in with_measured]
    return "\n".join(lines) + "\n"


def write_cost_report(out: str | Path, summary: dict) -> None:
    """Write ``summary.json`` and ``report.md`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text(render_markdown(summary))


def analyse(source: str, books: Sequence[PriceBook], block_tokens: int = 512) -> dict:
    """The summary for a trace file, a run directory or a workload spec."""
    path = Path(source)
    if path.is_dir():
        if not (path / "requests.jsonl").exists():
            raise CostSourceError(f"{source}: a run directory needs requests.jsonl")
        records = read_jsonl(path / "requests.jsonl")
        workload, why = run_workload(path)
        notes = [] if workload is not None else [f"{why}; only the measured savings are reported"]
        name = path.name
        return cost_summary(books, workload=workload, records=records, block_tokens=block_tokens,
                            source={"kind": "run", "path": str(path), "name": name,
                                    "workload": workload.name if workload else None}, notes=notes)
    workload = workload_of(source)
    return cost_summary(books, workload=workload, block_tokens=block_tokens,
                        source={"kind": "trace" if path.is_file() else "workload", "path": source,
                                "name": workload.name})
