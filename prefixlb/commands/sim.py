"""``prefixlb sim``: the offline fleet simulator (virtual time, the router's own policies, no HTTP).

    prefixlb sim --workload mooncake:TRACE --workers 8 --kv-blocks 16000 --policy cache_aware --out DIR

Writes the same run directory as ``prefixlb bench`` (requests.jsonl, summary.json, report.md,
plots), so ``prefixlb bench compare`` puts simulated and replayed runs side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from protocol.settings import SettingsError, build_parser, load_settings


def main(argv: list[str]) -> int:
    """Entry point of ``prefixlb sim``."""
    from bench.report import write_run
    from bench.sim.config import ENV_PREFIX, SimSettings, build_workload, fleet_config
    from bench.sim.fleet import simulate_with_bar
    from bench.workloads import WorkloadError

    parser = build_parser(SimSettings, env_prefix=ENV_PREFIX, prog="prefixlb sim", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        s = load_settings(SimSettings, parser.parse_args(argv), env_prefix=ENV_PREFIX)
        workload = build_workload(s)
        result = simulate_with_bar(workload, fleet_config(s), show=s.progress)
    except (SettingsError, WorkloadError, ValueError) as exc:
        print(f"prefixlb sim: {exc}", file=sys.stderr)
        return 2
    result.meta["label"] = s.label or Path(s.out).name
    summary = write_run(s.out, result.records, result.meta, fleet=list(result.meta["utilisation"]))
    print(json.dumps({k: summary[k] for k in ("requests", "errors", "hit_rate", "ttft_ms", "imbalance")}, indent=1))
    print(json.dumps({"prefill_tokens_computed": result.meta["prefill_tokens_computed"],
                      "kv_tier": result.meta["kv_tier"]}, indent=1))
    if result.meta.get("lora"):
        print(json.dumps({"lora": result.meta["lora"]}))
    print(f"simulated {len(workload)} requests on {s.workers} workers in {result.meta['wall_s']} s; results in {s.out}")
    return 0
