"""How fast the fleet simulator runs: wall seconds for W workers × N requests (target 1,000 × 1,000,000 < 60 s).

    .venv/bin/python -m bench.sim_scale --workers 1000 --requests 1000000 [--profile]

The workload is ``system-prompt`` with 5 tenants per worker (2,048-token system prompts,
Zipf popularity) arriving at 3 requests/s per worker, so the fleet is loaded like a production
one (busy ~40%, most requests hitting their tenant's prompt). Workload generation and the
simulation are timed separately; ``--profile`` prints the top functions (cProfile, ~2× slower).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from bench.sim.fleet import FleetConfig, simulate
from bench.sim.router import SimRouterConfig
from bench.stats import summarize
from bench.workloads import load_workload


def main(argv: list[str] | None = None) -> int:
    """Run one scale measurement and print it."""
    p = argparse.ArgumentParser(prog="python -m bench.sim_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--unit", type=int, default=512, help="simulator block in tokens")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--reference", action="store_true",
                   help="step with the reference worker (every running request every step), not the aggregate one")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    w = args.workers
    t0 = time.perf_counter()
    workload = load_workload("system-prompt", 0, args.requests, {
        "rate": str(3.0 * w), "tenants": str(5 * w), "system_tokens": "2048", "output_tokens": "32-128"})
    t1 = time.perf_counter()
    cfg = FleetConfig(workers=w, unit=args.unit, router=SimRouterConfig(policy=args.policy),
                      aggregate=not args.reference)
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    cpu = time.process_time()
    result = simulate(workload, cfg)
    cpu = time.process_time() - cpu
    if prof:
        prof.disable()
    t2 = time.perf_counter()
    s = summarize(result.records)
    print(f"workers={w} requests={args.requests} unit={args.unit} policy={args.policy} "
          f"worker={'reference' if args.reference else 'aggregate'}")
    print(f"workload generation {t1 - t0:.1f} s; simulation {t2 - t1:.1f} s wall, {cpu:.1f} s CPU "
          f"({(t2 - t1) / args.requests * 1e6:.0f} us/request wall); virtual span "
          f"{workload.requests[-1].arrival_s:.0f} s; busy {result.meta['mean_utilisation']:.0%}; "
          f"hit rate {s['hit_rate']:.3f}; TTFT p50 {s['ttft_ms']['p50']:.0f} ms p99 {s['ttft_ms']['p99']:.0f} ms")
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
