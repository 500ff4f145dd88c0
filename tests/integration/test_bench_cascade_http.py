"""``prefixlb bench cascade`` over HTTP: the real router, its cascades and two recorded-answer
workers measure the judges on a slice of the GSM8K answers; every deterministic number equals
the offline replay's, and the measured cost equals E[cost] = c_s + (1 − p)·c_l."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cascade_eval.dataset import load_dataset, split_halves
from bench.cascade_eval.offline import evaluate
from bench.cascade_eval.report import GSM8K_BOOK
from tests.support import ROOT

DATASET = Path("/work/shared/datasets/routellm_gsm8k_responses.csv")
JUDGES = ("format", "arithmetic", "format+arithmetic")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-cascade")
    with open(DATASET, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [row for _, row in zip(range(80), reader)]
        fields = reader.fieldnames
    data = tmp / "slice.csv"
    with open(data, "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    done = subprocess.run([sys.executable, "-m", "prefixlb", "bench", "cascade", "--dataset", str(data),
                           "--out", str(tmp / "out")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return data, tmp / "out", json.loads((tmp / "out" / "summary.json").read_text())


def test_the_summary_has_every_policy_measured_over_http_and_the_curve(run):
    _, out, summary = run
    assert summary["mode"].startswith("http")
    assert set(summary["policies"]) == {"always_weak", "always_strong", "random", *JUDGES}
    for entry in summary["policies"].values():
        assert {"accuracy", "strong_share", "cost"} <= set(entry)
    assert all("apgr" in summary["policies"][j] for j in JUDGES)
    assert (out / "curve.png").stat().st_size > 1000
    assert summary["split"] == {"seed": 0, "tune": 40, "test": 40}


def test_the_http_numbers_equal_the_offline_replay(run):
    data, _, summary = run
    dataset = load_dataset(data)
    tune, test = split_halves(dataset.questions, 0)
    offline = evaluate(dataset, tune, test, GSM8K_BOOK)
    for name in ("always_weak", "always_strong", *JUDGES):
        http, off = summary["policies"][name], offline[name]
        assert (http["accuracy"], http["strong_share"]) == (off["accuracy"], off["strong_share"]), name
        assert http["cost"] == pytest.approx(off["cost"], rel=1e-3), name
    for name in JUDGES:
        assert summary["policies"][name]["threshold"] == offline[name]["threshold"]
        assert summary["policies"][name]["apgr"] == pytest.approx(offline[name]["apgr"])


def test_the_measured_cost_is_the_expected_cost_of_the_cascade(run):
    _, _, summary = run
    for name in JUDGES:
        entry = summary["policies"][name]
        x = entry["expected_cost"]
        assert x["c_s"] + (1 - x["p_accept"]) * x["c_l_escalated"] == pytest.approx(entry["cost"], rel=1e-9)
        assert entry["cost_from_headers"] == pytest.approx(entry["cost"], rel=1e-9)
    usage = summary["router_usage"]["models"]
    assert set(usage) == {summary["weak_model"], summary["strong_model"]}
    assert all(m["unpriced_requests"] == 0 for m in usage.values())
