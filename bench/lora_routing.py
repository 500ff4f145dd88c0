"""Adapter-aware routing in the fleet simulator: the LoRA table of docs/benchmarks.md.

    python -m bench.lora_routing --num-requests 10000 --rates 100,200 --out runs/lora-routing

The ``multi-lora`` workload (200 tenant adapters with Zipf popularity, a system prompt per
tenant: ``bench/workloads/adapters.py``) on 8 simulated workers with 8 GPU LoRA slots each
(``--max-loras 8``, 32 adapters in host memory), through three routers: adapter-aware
``cache_aware`` (the default), ``cache_aware`` with ``adapter_routing`` off (prefix locality
only: the adapter is only part of the prefix namespace) and ``round_robin``. Per row: adapter
loads per 1,000 requests (host -> GPU slot copies, and disk reads), prefix-cache hit rate, TTFT
p50 / p99, imbalance (max / mean uncached prompt tokens per worker). Each rate runs twice: with a
system prompt per tenant (1,024 tokens: prefix locality alone already gives an adapter a home),
and without one (``system_tokens=0``: only the adapter ties a tenant's requests together).
``prefixlb bench report`` includes the same tables (``--lora-requests 0`` skips them).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.report import write_run
from bench.sim.fleet import FleetConfig, simulate
from bench.sim.router import SimRouterConfig
from bench.workloads import load_workload

ROWS = (("adapter-aware cache_aware", "cache_aware", True),
        ("prefix-only cache_aware", "cache_aware", False),
        ("round_robin", "round_robin", True))
WORKERS, MAX_LORAS, ADAPTERS = 8, 8, 200


SCENARIOS = (("a system prompt per tenant", ()), ("no shared prompt", ("system_tokens=0",)))


def lora_rows(num_requests: int, rate: float, out: Path, seed: int = 0,
              options: tuple[str, ...] = ()) -> list[tuple[str, dict, dict]]:
    """(label, summary, meta) of each router on the multi-lora workload at ``rate`` requests/s."""
    workload = load_workload("multi-lora", seed, num_requests,
                             [f"adapters={ADAPTERS}", f"rate={rate:g}", *options])
    rows = []
    for label, policy, adapter_routing in ROWS:
        cfg = FleetConfig(workers=WORKERS, unit=64, max_loras=MAX_LORAS,
                          router=SimRouterConfig(policy=policy, adapter_routing=adapter_routing))
        result = simulate(workload, cfg)
        result.meta["label"] = label
        name = f"rate{rate:g}" + "".join(f"-{o.replace('=', '')}" for o in options)
        summary = write_run(out / name / label.replace(" ", "_"), result.records, result.meta,
                            fleet=list(result.meta["utilisation"]))
        rows.append((label, summary, result.meta))
    return rows


def lora_table(rows: list[tuple[str, dict, dict]]) -> list[str]:
    """The markdown table of :func:`lora_rows`."""
    lines = ["| router | slot loads / 1k req | disk reads / 1k req | hit rate | TTFT p50 (s) | TTFT p99 (s) | "
             "imbalance | errors |", "|---|---|---|---|---|---|---|---|"]
    for label, s, meta in rows:
        lora = meta["lora"]
        t = s["ttft_ms"]
        lines.append(f"| {label} | {lora['slot_loads_per_1000']:.0f} | {lora['disk_loads_per_1000']:.0f} | "
                     f"{s['hit_rate']:.3f} | {t['p50'] / 1000:.3f} | {t['p99'] / 1000:.3f} | "
                     f"{s['imbalance']:.2f} | {s['errors']} |")
    return lines


def lora_section(num_requests: int, rates: tuple[float, ...], out: Path, seed: int = 0) -> list[str]:
    """The report's LoRA section: one table per arrival rate."""
    lines = [f"### Simulator: multi-lora ({ADAPTERS} adapters, Zipf 1.1), {WORKERS} workers x {MAX_LORAS} "
             f"LoRA slots, {num_requests} requests", ""]
    for title, options in SCENARIOS:
        for rate in rates:
            lines += [f"{title}, {rate:g} requests/s:", "",
                      *lora_table(lora_rows(num_requests, rate, out, seed, options)), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.lora_routing``."""
    p = argparse.ArgumentParser(prog="python -m bench.lora_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--rates", default="100,200", help="arrival rates, requests/s (comma list)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/lora-routing")
    args = p.parse_args(argv)
    rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    text = "\n".join(lora_section(args.num_requests, rates, Path(args.out), args.seed)) + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
