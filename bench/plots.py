"""PNG plots of runs (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from bench.records import RequestRecord  # noqa: E402


def _bins(records: Sequence[RequestRecord], n: int = 40) -> tuple[float, float]:
    ok = [r for r in records if r.ok]
    end = max((r.sent_s for r in ok), default=1.0) or 1.0
    return end / n, end


def ttft_cdf(runs: Mapping[str, Sequence[RequestRecord]], path: str | Path) -> None:
    """One TTFT CDF line per run (log-scaled time axis)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, records in runs.items():
        values = sorted(r.ttft_ms for r in records if r.ok and r.ttft_ms is not None)
        if values:
            ax.plot([v / 1000.0 for v in values], [(i + 1) / len(values) for i in range(len(values))],
                    label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hit_rate_over_time(runs: Mapping[str, Sequence[RequestRecord]], path: str | Path, n: int = 40) -> None:
    """Cached ÷ prompt tokens of the requests sent in each time bin, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, records in runs.items():
        width, _ = _bins(records, n)
        prompt = [0] * (n + 1)
        cached = [0] * (n + 1)
        for r in records:
            if r.ok:
                b = min(n, int(r.sent_s / width))
                prompt[b] += r.prompt_tokens
                cached[b] += r.cached_tokens
        xs = [(b + 0.5) * width for b in range(n + 1) if prompt[b]]
        ys = [cached[b] / prompt[b] for b in range(n + 1) if prompt[b]]
        ax.plot(xs, ys, label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("hit rate (cached / prompt tokens)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_per_worker(records: Sequence[RequestRecord], path: str | Path, n: int = 40) -> None:
    """Uncached prompt tokens (prefill work) sent to each worker per time bin."""
    width, _ = _bins(records, n)
    workers = sorted({r.worker_id or "unknown" for r in records if r.ok})
    series = {w: [0] * (n + 1) for w in workers}
    for r in records:
        if r.ok:
            series[r.worker_id or "unknown"][min(n, int(r.sent_s / width))] += r.prompt_tokens - r.cached_tokens
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [(b + 0.5) * width for b in range(n + 1)]
    for w in workers:
        ax.plot(xs, [v / width for v in series[w]], label=w, linewidth=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("uncached prompt tokens / s")
    ax.grid(True, alpha=0.3)
    if workers and len(workers) <= 16:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tradeoff(xs: Sequence[float], hit_rates: Sequence[float], p99_ms: Sequence[float], path: str | Path,
             xlabel: str = "affinity") -> None:
    """Hit rate and p99 TTFT against one knob (two y axes): the sweep's curve."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, hit_rates, "o-", color="tab:blue", label="hit rate")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("hit rate", color="tab:blue")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(xs, [p / 1000.0 for p in p99_ms], "s--", color="tab:red", label="p99 TTFT")
    ax2.set_ylabel("p99 TTFT (s)", color="tab:red")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
