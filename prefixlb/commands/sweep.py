"""``prefixlb sweep``: cache_aware at affinity 0..1 in the fleet simulator; hit rate and p99 TTFT.

    prefixlb sweep --workload mooncake:TRACE --workers 8 --kv-blocks 16000 --out DIR [--affinities 0,0.5,0.8,1]

Takes every ``prefixlb sim`` option; writes sweep.json, sweep.md and sweep.png (the curve
operators use to choose their affinity).
"""
from __future__ import annotations

import argparse
import sys

from protocol.settings import SettingsError, build_parser, load_settings


def main(argv: list[str]) -> int:
    """Entry point of ``prefixlb sweep``."""
    from bench.sim.config import ENV_PREFIX, SimSettings
    from bench.sweep import DEFAULT_AFFINITIES, sweep
    from bench.workloads import WorkloadError

    parser = build_parser(SimSettings, env_prefix=ENV_PREFIX, prog="prefixlb sweep", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--affinities", default=",".join(f"{a:g}" for a in DEFAULT_AFFINITIES),
                        help="comma-separated affinity values in [0, 1]")
    try:
        args = parser.parse_args(argv)
        affinities = [float(a) for a in args.affinities.split(",") if a.strip()]
        if not affinities or any(not 0.0 <= a <= 1.0 for a in affinities):
            raise SettingsError("--affinities: values must be in [0, 1]")
        del args.affinities
        s = load_settings(SimSettings, args, env_prefix=ENV_PREFIX)
        rows = sweep(s, affinities, s.out)
    except (SettingsError, WorkloadError, ValueError) as exc:
        print(f"prefixlb sweep: {exc}", file=sys.stderr)
        return 2
    print(f"{'affinity':>8} {'hit rate':>9} {'p50 s':>8} {'p99 s':>8} {'imbalance':>9}")
    for r in rows:
        t = r["summary"]["ttft_ms"]
        print(f"{r['affinity']:>8g} {r['summary']['hit_rate']:>9.3f} {t['p50'] / 1000:>8.3f} "
              f"{t['p99'] / 1000:>8.3f} {r['summary']['imbalance']:>9.3f}")
    print(f"results in {s.out}")
    return 0
