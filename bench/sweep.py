"""Affinity sweep: the same workload and fleet at affinity 0..1, hit rate and p99 TTFT for each.

The curve operators read to choose their affinity (and that chose the router's default): hit
rate rises with affinity while p99 TTFT first falls (fewer prefills) and then rises again once
locality beats load (queues behind popular workers).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from bench import plots
from bench.report import table
from bench.sim.config import SimSettings, build_workload, fleet_config
from bench.sim.fleet import simulate
from bench.stats import summarize

DEFAULT_AFFINITIES = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def sweep(settings: SimSettings, affinities: Sequence[float] = DEFAULT_AFFINITIES,
          out: str | Path | None = None) -> list[dict]:
    """Simulate ``cache_aware`` at each affinity; rows of (affinity, summary, meta). With
    ``settings.progress`` one bar on stderr counts the requests of every affinity's run."""
    from tqdm import tqdm

    workload = build_workload(settings)
    rows = []
    bar = tqdm(total=len(workload) * len(affinities), disable=not settings.progress, unit="req")
    for a in affinities:
        bar.set_description(f"affinity {a:g}")
        result = simulate(workload, fleet_config(replace(settings, policy="cache_aware"), affinity=a),
                          progress=bar.update)
        summary = summarize(result.records, fleet=list(result.meta["utilisation"]))
        rows.append({"affinity": a, "summary": summary, "wall_s": result.meta["wall_s"],
                     "reasons": result.meta["reasons"]})
    bar.close()
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
        plots.tradeoff([r["affinity"] for r in rows], [r["summary"]["hit_rate"] for r in rows],
                       [r["summary"]["ttft_ms"]["p99"] for r in rows], out / "sweep.png")
        text = table([(f"affinity {r['affinity']:g}", r["summary"]) for r in rows])
        (out / "sweep.md").write_text(f"# Affinity sweep: {workload.name}, {settings.workers} workers\n\n"
                                      f"{text}\n\n![hit rate and p99 TTFT vs affinity](sweep.png)\n")
    return rows
