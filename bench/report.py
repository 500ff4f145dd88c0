"""A run directory (``requests.jsonl``, ``summary.json``, ``meta.json``, ``report.md``, plots) and
``compare``: several runs side by side in one table and one plot."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from bench import plots
from bench.records import RequestRecord, read_jsonl, write_jsonl
from bench.stats import send_lag, summarize

TABLE_HEADER = ("| run | requests | errors | hit rate | TTFT p50 (s) | p90 (s) | p99 (s) | "
                "req/s | out tok/s | imbalance |")


def _s(ms: float) -> str:
    return "n/a" if ms is None or (isinstance(ms, float) and math.isnan(ms)) else f"{ms / 1000.0:.3f}"


def table_row(label: str, summary: dict) -> str:
    """One markdown table row for a summary."""
    t = summary["ttft_ms"]
    return (f"| {label} | {summary['requests']} | {summary['errors']} | {summary['hit_rate']:.3f} | "
            f"{_s(t['p50'])} | {_s(t['p90'])} | {_s(t['p99'])} | {summary['req_per_s']:.3f} | "
            f"{summary['output_tokens_per_s']:.1f} | {summary['imbalance']:.3f} |")


def table(rows: Sequence[tuple[str, dict]]) -> str:
    """A markdown table of several summaries."""
    sep = "|" + "---|" * TABLE_HEADER.count(" |")
    return "\n".join([TABLE_HEADER, sep, *(table_row(label, s) for label, s in rows)])


def write_run(out: str | Path, records: Sequence[RequestRecord], meta: dict,
              fleet: Sequence[str] = ()) -> dict:
    """Write a complete run directory and return its summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, fleet)
    write_jsonl(records, out / "requests.jsonl")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    label = meta.get("label") or out.name
    plots.ttft_cdf({label: records}, out / "ttft_cdf.png")
    plots.hit_rate_over_time({label: records}, out / "hit_rate.png")
    plots.load_per_worker(records, out / "load_per_worker.png")
    lines = [f"# Run {label}", "", "```", json.dumps(meta, indent=1, default=str), "```", "",
             table([(label, summary)]), "", "| worker | requests | prompt tokens | cached tokens | hit rate |",
             "|---|---|---|---|---|"]
    for w, row in summary["per_worker"].items():
        rate = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        lines.append(f"| {w} | {row['requests']} | {row['prompt_tokens']} | {row['cached_tokens']} | {rate:.3f} |")
    lag = send_lag(records)
    if lag is not None:
        lines += ["", f"Load generator behind its schedule (send lag, ms): p50 {lag['p50']:.1f}, "
                      f"p99 {lag['p99']:.1f}, mean {lag['mean']:.1f}"]
    errors = [r.error for r in records if not r.ok]
    if errors:
        lines += ["", f"First errors ({len(errors)} in all):", ""] + [f"- `{e}`" for e in errors[:5]]
    lines += ["", "![TTFT CDF](ttft_cdf.png) ![hit rate](hit_rate.png) ![load](load_per_worker.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    return summary


def load_run(run_dir: str | Path) -> tuple[str, dict, list[RequestRecord]]:
    """(label, summary, records) of a run directory."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    meta_path = run_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    records = read_jsonl(run_dir / "requests.jsonl") if (run_dir / "requests.jsonl").exists() else []
    return meta.get("label") or run_dir.name, summary, records


def compare(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> str:
    """A markdown table of several runs; with ``out``, also ``compare.md`` and plots there."""
    runs = [load_run(d) for d in run_dirs]
    text = table([(label, summary) for label, summary, _ in runs])
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        by_label = {label: records for label, _, records in runs}
        plots.ttft_cdf(by_label, out / "ttft_cdf.png")
        plots.hit_rate_over_time(by_label, out / "hit_rate.png")
        (out / "compare.md").write_text(text + "\n\n![TTFT CDF](ttft_cdf.png) ![hit rate](hit_rate.png)\n")
    return text
