"""``prefixlb bench``: drive a workload against an endpoint; ``bench compare``; ``bench report``.

    prefixlb bench --target URL --workload W [--speedup S] [--time-scale X]
                   [--rate R | --concurrency N] [--duration D] [--out DIR]
    prefixlb bench compare RUN_DIR... [--out DIR]
    prefixlb bench report [--out DIR] [--quick]      (the routing report of docs/benchmarks.md)
    prefixlb bench cascade --dataset FILE --out DIR [--price-book FILE] [--seed N]
                                                     (cascade judges on recorded answers, offline)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.settings import SettingsError, build_parser, describe, load_settings, setting

log = logging.getLogger("prefixlb.bench")


@dataclass(slots=True)
class BenchConfig:
    """Settings of one load-generator run (flags, ``PREFIXLB_BENCH_*`` env, or YAML)."""

    target: str = setting("http://127.0.0.1:8000", "base URL of the OpenAI-compatible endpoint")
    workload: str = setting("system-prompt", "system-prompt | doc-qa | multi-turn | mooncake:FILE | azure:FILE")
    workload_opt: list[str] = setting(list, "workload option key=value (repeatable)", flag="--workload-opt")
    seed: int = setting(0, "seed: the workload is deterministic given it")
    num_requests: int | None = setting(None, "number of requests (default: the workload's own)", minimum=1)
    model: str | None = setting(None, "model name sent in each request (default: the target's first model)")
    speedup: float = setting(1.0, "divide the workload's arrival times by this", minimum=1e-6)
    time_scale: float = setting(1.0, "the simulated workers run this many times faster; times are scaled back",
                                minimum=1e-6)
    rate: float | None = setting(None, "replace arrivals by a Poisson process of this many req/s", minimum=1e-9)
    concurrency: int | None = setting(None, "closed loop: keep this many requests in flight", minimum=1)
    duration: float | None = setting(None, "stop sending after this many seconds (workload time)", minimum=0.0)
    out: str = setting("runs/bench", "output directory")
    label: str | None = setting(None, "name of this run in reports (default: the directory name)")
    fleet: list[str] = setting(list, "worker id of the fleet (repeatable): idle workers count in imbalance")
    session_header: str = setting("x-session-id", "header that carries a request's session")
    request_timeout: float = setting(600.0, "per-request timeout in seconds (wall clock)", minimum=0.1)
    progress: bool = setting(True, "show a progress bar")
    api_key: str | None = setting(None, "API key sent as 'Authorization: Bearer <key>' (default: env "
                                  "OPENAI_API_KEY)", secret=True)
    endpoint: str = setting("completions", "API driven: completions, or chat (the prompt as one user message)",
                            choices=("completions", "chat"))


def run_bench(cfg: BenchConfig) -> dict:
    """Run one load-generator pass and write its run directory; returns the summary."""
    from bench.loadgen import LoadConfig, run_load
    from bench.report import write_run
    from bench.workloads import TextSource, load_workload
    from bench.workloads.base import retime_poisson

    workload = load_workload(cfg.workload, cfg.seed, cfg.num_requests, cfg.workload_opt)
    if cfg.rate is not None:
        workload = retime_poisson(workload, cfg.rate, cfg.seed)
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
    load = LoadConfig(target=cfg.target, model=cfg.model, time_scale=cfg.time_scale, speedup=cfg.speedup,
                      concurrency=cfg.concurrency, duration_s=cfg.duration,
                      request_timeout_s=cfg.request_timeout, session_header=cfg.session_header,
                      headers={"Authorization": f"Bearer {key}"} if key else {},
                      progress=cfg.progress, seed=cfg.seed, chat=cfg.endpoint == "chat")
    started = time.time()
    records = asyncio.run(run_load(workload, load, TextSource(cfg.seed)))
    meta = {"label": cfg.label or Path(cfg.out).name, "kind": "http", "config": describe(cfg),  # key masked
            "workload": workload.name, "workload_params": workload.params,
            "wall_s": round(time.time() - started, 3)}
    return write_run(cfg.out, records, meta, cfg.fleet)


def _compare(argv: list[str]) -> int:
    from bench.report import compare

    parser = argparse.ArgumentParser(prog="prefixlb bench compare", description="runs side by side")
    parser.add_argument("runs", nargs="+", help="run directories (each with summary.json)")
    parser.add_argument("--out", default=None, help="write compare.md and plots here")
    args = parser.parse_args(argv)
    missing = [r for r in args.runs if not (Path(r) / "summary.json").exists()]
    if missing:
        print(f"prefixlb bench compare: no summary.json in {', '.join(missing)}", file=sys.stderr)
        return 2
    print(compare(args.runs, args.out))
    return 0


def _cascade(argv: list[str]) -> int:
    from bench.cascade_eval.dataset import DatasetError
    from bench.cascade_eval.report import GSM8K_BOOK, run_offline, write_cascade_report
    from router.cost.price_book import PriceBookError, load_price_book

    parser = argparse.ArgumentParser(
        prog="prefixlb bench cascade",
        description="Cascade judges vs always-weak, always-strong and random routing on recorded answers: "
                    "thresholds chosen on one half, reported on the other. By default over HTTP: the real router "
                    "and its cascade virtual models in front of two recorded-answer simulated workers; "
                    "--offline: the judges read the recorded answers directly (seconds).")
    parser.add_argument("--dataset", required=True, help="responses CSV (RouteLLM layout)")
    parser.add_argument("--out", default="runs/cascade", help="output directory")
    parser.add_argument("--price-book", default=None, help="YAML price book naming both models "
                                                           "(default: 2024 list prices of the GSM8K models)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the 50/50 split")
    parser.add_argument("--offline", action="store_true", help="no router, no HTTP: apply the judges to the "
                                                               "recorded answers directly")
    args = parser.parse_args(argv)
    try:
        book = load_price_book(args.price_book) if args.price_book else GSM8K_BOOK
        if args.offline:
            summary = run_offline(args.dataset, book, args.seed)
        else:
            from bench.cascade_eval.http_run import run_http

            summary = run_http(args.dataset, book, args.seed, args.out)
        write_cascade_report(args.out, summary)
    except (DatasetError, PriceBookError, ValueError, OSError, RuntimeError) as exc:
        print(f"prefixlb bench cascade: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({name: {k: round(e[k], 6) for k in ("accuracy", "strong_share", "cost")}
                      for name, e in summary["policies"].items()}, indent=1))
    print(f"results in {args.out}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of ``prefixlb bench``."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if argv and argv[0] == "compare":
        return _compare(argv[1:])
    if argv and argv[0] == "cascade":
        return _cascade(argv[1:])
    if argv and argv[0] == "report":
        from bench.routing_report import main as report_main

        return report_main(argv[1:])
    parser = build_parser(BenchConfig, env_prefix="PREFIXLB_BENCH_", prog="prefixlb bench",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        cfg = load_settings(BenchConfig, parser.parse_args(argv), env_prefix="PREFIXLB_BENCH_")
        if cfg.rate is not None and cfg.concurrency is not None:
            raise SettingsError("--rate and --concurrency exclude each other")
        summary = run_bench(cfg)
    except (SettingsError, ValueError, OSError, RuntimeError) as exc:
        print(f"prefixlb bench: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("requests", "errors", "hit_rate", "ttft_ms", "imbalance")}, indent=1))
    print(f"results in {cfg.out}")
    return 0
