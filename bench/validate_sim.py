"""The fleet simulator against the HTTP replay on one small case (target: hit rates within 2 points,
TTFT p50 within 10%).

    .venv/bin/python -m bench.validate_sim [--workers 4] [--requests 300] [--speedup 0.5] [--time-scale 1]

Same trace prefix, same fleet (simulated H100s, Llama-3-8B, same KV blocks), same router policy:
once through ``prefixlb sim`` (virtual time), once through real processes (``prefixlb worker
--simulate`` behind ``prefixlb router`` with Redis, the bench's load generator). At time scale 1
HTTP overhead is not multiplied, so the remaining differences are the simulator's.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.routing_report import DEFAULT_TRACE, ReportPlan, _fleet, http_run, validation
from bench.sim.fleet import simulate
from bench.stats import summarize
from bench.workloads import load_workload
from router.routing.policies import get_policy
from router.routing.policy import DEFAULT_AFFINITY


def main(argv: list[str] | None = None) -> int:
    """Run the validation and print its table."""
    p = argparse.ArgumentParser(prog="python -m bench.validate_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--workload", default=None, help="a workload spec instead of the trace (e.g. conversation)")
    p.add_argument("--workload-opt", action="append", default=[], help="workload option key=value (repeatable)")
    p.add_argument("--unit", type=int, default=512, help="the simulator's block in tokens")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--speedup", type=float, default=0.5)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--kv-blocks", type=int, default=16000)
    p.add_argument("--policies", default="round_robin,cache_aware")
    p.add_argument("--out", default="runs/validate")
    args = p.parse_args(argv)
    plan = ReportPlan(trace=args.trace, workers=args.workers, kv_blocks=args.kv_blocks, speedup=args.speedup,
                      time_scale=args.time_scale, out=Path(args.out))
    spec = args.workload or f"mooncake:{args.trace}"
    workload = load_workload(spec, 0, args.requests, args.workload_opt or None)
    sim_rows, http_rows = [], []
    for policy in args.policies.split(","):
        affinity = DEFAULT_AFFINITY if get_policy(policy).uses_affinity else None
        label = f"prefixlb {policy}" + (f" a={affinity:g}" if affinity is not None else "")
        result = simulate(workload, _fleet(plan, args.workers, args.unit, args.speedup, policy, affinity,
                                           time_scale=args.time_scale))
        sim_rows.append((label, summarize(result.records, fleet=list(result.meta["utilisation"])), result.meta))
        http_rows.append(http_run(plan, label, workload, "prefixlb", policy, affinity))
    lines = [f"{args.requests} requests of {workload.name}, {args.workers} workers, speed-up {args.speedup:g}, "
             f"time scale {args.time_scale:g}, {args.kv_blocks} KV blocks per worker", "",
             *validation(sim_rows, http_rows)]
    text = "\n".join(lines)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "validation.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
