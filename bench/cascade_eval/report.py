"""``prefixlb bench cascade``'s outputs: ``summary.json`` (one entry per policy), ``report.md``
and ``curve.png`` (accuracy vs share of strong calls on the held-out half)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from bench.cascade_eval.dataset import RoutingDataset, load_dataset, split_halves  # noqa: E402
from bench.cascade_eval.offline import EXCLUDED_JUDGES, evaluate  # noqa: E402
from router.cost.price_book import HostedPrice, PriceBook  # noqa: E402

# List prices of 2024 (USD per million tokens): gpt-4-1106-preview at OpenAI, Mixtral-8x7B at
# the hosted open-model providers. Examples for the GSM8K file; pass --price-book for yours.
GSM8K_BOOK = PriceBook({"mistralai/Mixtral-8x7B-Instruct-v0.1": HostedPrice(0.60, 0.60),
                        "gpt-4-1106-preview": HostedPrice(10.0, 30.0)}, "gsm8k-2024-list-prices")


def run_offline(dataset_path: str | Path, book: PriceBook = GSM8K_BOOK, seed: int = 0) -> dict:
    """The summary of the offline evaluation of ``dataset_path``."""
    dataset = load_dataset(dataset_path)
    tune, test = split_halves(dataset.questions, seed)
    return {
        "mode": "offline: the judges read the recorded answers directly (no router, no HTTP)",
        "dataset": str(dataset_path), "weak_model": dataset.weak_model, "strong_model": dataset.strong_model,
        "price_book": book.name,
        "split": {"seed": seed, "tune": len(tune), "test": len(test)},
        "test": {"weak_accuracy": RoutingDataset.accuracy(test, False),
                 "strong_accuracy": RoutingDataset.accuracy(test, True)},
        "policies": evaluate(dataset, tune, test, book),
        "excluded_judges": EXCLUDED_JUDGES,
    }


def plot_curve(summary: dict, path: str | Path) -> None:
    """Each judge's curve on the held-out half, its chosen point, random routing, the two models."""
    weak, strong = summary["test"]["weak_accuracy"], summary["test"]["strong_accuracy"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, entry in summary["policies"].items():
        if "curve" not in entry:
            continue
        xs = [p["strong_share"] * 100 for p in entry["curve"]]
        ys = [p["accuracy"] * 100 for p in entry["curve"]]
        line, = ax.plot(xs, ys, marker=".", label=f"{name} (APGR {entry['apgr']:.3f})")
        ax.plot([entry["strong_share"] * 100], [entry["accuracy"] * 100], marker="o", markersize=9,
                markerfacecolor="none", color=line.get_color())
    ax.plot([0, 100], [weak * 100, strong * 100], linestyle=":", color="black", label="random (APGR 0.500)")
    ax.axhline(weak * 100, linestyle="--", color="grey", label=f"{summary['weak_model']} (always weak)")
    ax.axhline(strong * 100, linestyle="--", color="red", label=f"{summary['strong_model']} (always strong)")
    ax.set_xlabel("strong model calls (%)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Cascade judges on the held-out half (circles: chosen thresholds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def render_markdown(summary: dict) -> str:
    """``report.md`` of a summary."""
    t = summary["test"]
    lines = [f"# Cascade judges on {Path(summary['dataset']).name}", "", f"Mode: {summary['mode']}.", "",
             f"Weak {summary['weak_model']} ({t['weak_accuracy']:.1%} on the held-out half), strong "
             f"{summary['strong_model']} ({t['strong_accuracy']:.1%}); thresholds chosen on {summary['split']['tune']} "
             f"questions, reported on the other {summary['split']['test']} (seed {summary['split']['seed']}); "
             f"prices: {summary['price_book']} (USD per request; tokens are the replay's bytes).", "",
             "| policy | accuracy | strong share | cost per request | PGR | APGR | CPT(50%) | CPT(80%) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, e in summary["policies"].items():
        label = name if name != "random" else f"random (at {e['matched_to']}'s share)"
        lines.append(f"| {label} | {e['accuracy']:.1%} | {e['strong_share']:.1%} | {e['cost']:.6f} | {e['pgr']:.3f} | "
                     f"{e['apgr']:.3f} | {_pct(e.get('cpt50'))} | {_pct(e.get('cpt80'))} |"
                     if "apgr" in e else
                     f"| {label} | {e['accuracy']:.1%} | {e['strong_share']:.1%} | {e['cost']:.6f} | {e['pgr']:.3f} | | | |")
    lines += ["", "E[cost] = c_s + (1 − p)·c_l per judge (p: accepted share; c_l over the escalated questions, and "
                  "with the mean c_l of all questions):", ""]
    for name, e in summary["policies"].items():
        if "expected_cost" in e:
            x = e["expected_cost"]
            lines.append(f"- {name}: p = {x['p_accept']:.3f}, c_s = {x['c_s']:.6f}, c_l = {x['c_l_escalated']:.6f} "
                         f"-> {x['formula']:.6f} (measured {e['cost']:.6f}); with mean c_l {x['c_l_mean']:.6f} -> "
                         f"{x['formula_with_mean_c_l']:.6f}; random routing at the same share costs "
                         f"{e['random_at_same_share']['cost']:.6f} for {e['random_at_same_share']['accuracy']:.1%}")
    lines += ["", "Not evaluated here:", ""] + [f"- {k}: {v}" for k, v in summary["excluded_judges"].items()]
    lines += ["", "![accuracy vs strong share](curve.png)", ""]
    return "\n".join(lines)


def write_cascade_report(out: str | Path, summary: dict) -> None:
    """Write ``summary.json``, ``report.md`` and ``curve.png`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    (out / "report.md").write_text(render_markdown(summary))
    plot_curve(summary, out / "curve.png")
