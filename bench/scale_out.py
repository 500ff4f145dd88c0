"""Scale-out cold misses: what adding a worker under load costs, with and without pre-warming.

A fleet serves bursty traffic over a set of hot documents (every request: one document + a new
question). Mid-run a worker joins (it registers itself through Redis). Its cache is empty, so
whatever it is sent of the hot documents misses -- the *cold-miss burst*. With ``--prewarm-top
K`` the router first sends it the K hottest prefixes (``max_tokens=1``) and only then routes to
it. For each policy, the same workload runs on a fresh fleet twice, without and with
pre-warming, and the window after the join is compared:

* **new worker**: requests it served, how many of them missed their document (cached tokens
  below the document's length), its hit rate (cached / prompt tokens);
* **fleet**: prompt tokens computed (not cached) in the window, and TTFT p50 / p99.

    python -m bench.scale_out --out runs/scale-out

Local processes only: a private ``redis-server``, simulated workers, one router
(``bench/cluster.py``); the load is ``bench.loadgen`` in open loop, so a slow fleet does not
slow the arrivals.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.cluster import cluster
from bench.loadgen import LoadConfig, run_load
from bench.records import RequestRecord
from bench.cluster import RedisServer
from bench.workloads.base import RequestSpec, Workload

ADMIN_TOKEN = "bench"


def bursty_hot_documents(documents: int, doc_tokens: int, rate: float, seconds: float, burst_s: float,
                         gap_s: float, seed: int) -> Workload:
    """Bursts of requests at ``rate`` (``burst_s`` on, ``gap_s`` off), each a hot document
    (Zipf-ish popularity) plus a question of its own."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, documents + 1)
    weights /= weights.sum()
    requests, t, i = [], 0.0, 0
    while t < seconds:
        phase = t % (burst_s + gap_s)
        if phase >= burst_s:
            t += burst_s + gap_s - phase
            continue
        doc = int(rng.choice(documents, p=weights))
        requests.append(RequestSpec(i, t, ((doc + 1, doc_tokens), (100_000 + i, 48)), 16))
        t += rng.exponential(1.0 / rate)
        i += 1
    return Workload("bursty-hot-documents", requests, model="llama-3-8b")


def window_stats(records: list[RequestRecord], start_s: float, end_s: float, new_worker: str,
                 doc_tokens: int) -> dict:
    """What happened to requests sent in ``[start_s, end_s)``."""
    window = [r for r in records if start_s <= r.sent_s < end_s and r.ok]
    new = [r for r in window if r.worker_id == new_worker]
    ttft = [r.ttft_ms for r in window if r.ttft_ms is not None]
    misses = [r for r in new if r.cached_tokens < doc_tokens - 16]

    def pct(q: float) -> float | None:
        return round(float(np.percentile(ttft, q)), 1) if ttft else None

    return {
        "requests": len(window), "errors": sum(1 for r in records if start_s <= r.sent_s < end_s and not r.ok),
        "new_worker_requests": len(new), "new_worker_cold_misses": len(misses),
        "new_worker_first10_misses": sum(1 for r in sorted(new, key=lambda r: r.sent_s)[:10]
                                          if r.cached_tokens < doc_tokens - 16),
        "new_worker_hit_rate": round(sum(r.cached_tokens for r in new) / max(1, sum(r.prompt_tokens for r in new)), 3),
        "fleet_uncached_tokens": sum(r.prompt_tokens - r.cached_tokens for r in window),
        "fleet_hit_rate": round(sum(r.cached_tokens for r in window) / max(1, sum(r.prompt_tokens for r in window)), 3),
        "ttft_p50_ms": pct(50), "ttft_p99_ms": pct(99),
    }


def one_run(args: argparse.Namespace, policy: str, prewarm: int, out: Path) -> dict:
    workload = bursty_hot_documents(args.documents, args.doc_tokens, args.rate, args.seconds, args.burst,
                                    args.gap, args.seed)
    name = f"{policy}-prewarm{prewarm}"
    with RedisServer(out / name / "redis") as redis_server, cluster(out / name / "logs") as c:
        workers = c.workers(args.workers, args.time_scale, redis=redis_server.url, kv_blocks=args.kv_blocks)
        router = c.router(workers, policy, redis=redis_server.url,
                          extra=["--prewarm-top", str(prewarm), "--admin-token", ADMIN_TOKEN,
                                 "--health-interval", "0.5", "--registry-interval", "0.2"])
        joined: dict[str, float] = {}
        cfg = LoadConfig(router.url, model="llama-3-8b", time_scale=args.time_scale, progress=False,
                         seed=args.seed)

        async def join_later(started: float) -> None:
            # Workload time = wall time x time_scale; the join lands mid-burst.
            await asyncio.sleep(args.join_at / args.time_scale)
            t0 = time.perf_counter()
            await asyncio.to_thread(c.workers, 1, args.time_scale, args.kv_blocks, (), redis_server.url, None, "new")
            joined["workload_s"] = (time.perf_counter() - started) * args.time_scale
            joined["start_s"] = time.perf_counter() - t0

        async def run() -> list[RequestRecord]:
            started = time.perf_counter()
            records, _ = await asyncio.gather(run_load(workload, cfg), join_later(started))
            return records

        records = asyncio.run(run())
    at = joined["workload_s"]
    return {"policy": policy, "prewarm_top": prewarm, "joined_at_s": round(at, 1),
            "window_s": args.window, **window_stats(records, at, at + args.window, "new-0", args.doc_tokens)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="cache_aware,consistent_hash")
    p.add_argument("--prewarm-top", type=int, default=16, help="K for the pre-warmed runs")
    p.add_argument("--workers", type=int, default=3, help="workers before the join (one more joins)")
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=4096)
    p.add_argument("--rate", type=float, default=12.0, help="requests/s during a burst (workload time)")
    p.add_argument("--burst", type=float, default=20.0, help="seconds of each burst (workload time)")
    p.add_argument("--gap", type=float, default=10.0, help="seconds between bursts (workload time)")
    p.add_argument("--seconds", type=float, default=90.0, help="workload length (workload time)")
    p.add_argument("--join-at", type=float, default=32.0, help="when the new worker starts (workload time)")
    p.add_argument("--window", type=float, default=30.0, help="seconds after the join that are compared")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per worker (default: the GPU's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/scale-out")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy in args.policies.split(","):
        for prewarm in (0, args.prewarm_top):
            row = one_run(args, policy, prewarm, out)
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| policy | pre-warm K | new worker: requests | its cold misses (first 10) | its hit rate | "
             "fleet uncached tokens | fleet hit rate | TTFT p50 / p99 (ms) | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['prewarm_top']} | {r['new_worker_requests']} | "
                     f"{r['new_worker_cold_misses']} ({r['new_worker_first10_misses']}) | {r['new_worker_hit_rate']} | "
                     f"{r['fleet_uncached_tokens']} | {r['fleet_hit_rate']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
                     f"{r['errors']} |")
    table = "\n".join(lines) + "\n"
    command = "python -m bench.scale_out " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "scale_out.json").write_text(json.dumps({"args": vars(args), "rows": rows, "command": command}, indent=2))
    (out / "scale_out.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
