"""``prefixlb cost``: what prefix caching saves on a trace or a run, under price books.

    prefixlb cost SOURCE [--price-book FILE]... [--block-tokens 512] [--out DIR]

SOURCE is a Mooncake trace (``.jsonl``), an Azure trace (``.csv``), a run directory of
``prefixlb bench`` or a generated workload name (``doc-qa``). Writes ``DIR/report.md`` and
``DIR/summary.json``: savings per TTL (5 minutes, 1 hour), reuse counts of every write, the
break-even read count of each price, and the prefixes whose writes did not pay (docs:
"Cost accounting"). Without ``--price-book`` the reference book prices input in units of the
input price with the source texts' multipliers (write 1.25x / 2x, read 0.1x).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def latency_model_prefill_speed(gpu: str, sim_model: str) -> float:
    """A replica's linear-equivalent prefill tokens/s on the simulated worker's latency model."""
    from worker.simulator.latency import LatencyModel
    from worker.simulator.profiles import ProfileError, get_gpu, get_model
    from worker.simulator.runner import nominal_speed

    try:
        return nominal_speed(LatencyModel(get_gpu(gpu), get_model(sim_model)))[0]
    except ProfileError as exc:
        raise ValueError(str(exc)) from None


def main(argv: list[str]) -> int:
    """Entry point of ``prefixlb cost``."""
    from bench.cost.report import CostSourceError, analyse, write_cost_report
    from router.cost.price_book import REFERENCE_BOOK, PriceBookError, load_price_book

    parser = argparse.ArgumentParser(prog="prefixlb cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="trace file (.jsonl Mooncake, .csv Azure), run directory or workload name")
    parser.add_argument("--price-book", action="append", default=[], metavar="FILE",
                        help="YAML price book (repeatable; default: the reference book)")
    parser.add_argument("--block-tokens", type=int, default=512, help="cache block size in tokens (default 512)")
    parser.add_argument("--out", default="runs/cost", help="output directory (default runs/cost)")
    args = parser.parse_args(argv)
    if args.block_tokens <= 0:
        print("prefixlb cost: --block-tokens must be positive", file=sys.stderr)
        return 2
    try:
        books = [load_price_book(p, latency_model_prefill_speed) for p in args.price_book] or [REFERENCE_BOOK]
        summary = analyse(args.source, books, args.block_tokens)
        write_cost_report(args.out, summary)
    except (PriceBookError, CostSourceError, OSError) as exc:
        print(f"prefixlb cost: {exc}", file=sys.stderr)
        return 2
    brief = [{"book": m["book"], "model": m["model"],
              **({ttl: round(t["saved_fraction"], 4) for ttl, t in m.get("ttl", {}).items() if "saved_fraction" in t})}
             for m in summary["models"]]
    print(json.dumps({"requests": summary["requests"], "saved_fraction": brief}, indent=1))
    print(f"report in {Path(args.out) / 'report.md'}")
    return 0
