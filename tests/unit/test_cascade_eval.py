"""The offline cascade evaluation: the arithmetic verifier, the dataset, every policy's entry
(with E[cost] = c_s + (1 - p) c_l equal to the measured cost), and `prefixlb bench cascade`."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from bench.cascade_eval.arithmetic import arithmetic_score, claims, evaluate
from bench.cascade_eval.dataset import DatasetError, load_dataset, split_halves
from bench.cascade_eval.offline import ArithmeticJudge, evaluate as evaluate_policies, gsm8k_judges, token_counts
from bench.cascade_eval.report import run_offline
from router.cost.price_book import HostedPrice, PriceBook
from router.virtual_models.judges.format import RegexJudge
from tests.support import ROOT

DATASET = "/work/shared/datasets/routellm_gsm8k_responses.csv"


@pytest.mark.parametrize("expression, value", [("48/2", 24.0), ("$9 * 2", 18.0), ("1,200 - 200", 1000.0),
                                               ("(3 + 4) × 2", 14.0), ("180 x 3", 540.0), ("-5 + 2", -3.0),
                                               ("__import__('os')", None), ("2 ** 99999", None), ("1/0", None)])
def test_only_arithmetic_on_numbers_is_evaluated(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("answer, score", [
    ("She sells 9 * $2 = $<<9*2=18>>18.\n#### 18", 1.0),
    ("16 - 3 - 4 = 9 eggs, 9 * 2 = 20 dollars", 0.5),
    # A chain is checked as its last step only: "= 500 - 2 = 498".
    ("4 * 125 = 500 - 2 = 498", 1.0),
    ("4 * 125 = 500 - 2 = 497", 0.0),
    # A whole number that a fraction rounds to is accepted ("you can't buy half a bus").
    ("73/8 = 9 buses", 1.0),
    ("No arithmetic here.", 1.0),
])
def test_the_arithmetic_score_is_the_share_of_claims_that_hold(answer, score):
    assert arithmetic_score(answer) == pytest.approx(score)


def test_a_chained_claim_is_read_whole():
    assert [(e, c, s) for e, c, s in claims("x = 22 + 4 x 12 = 22 + 48 = 70")] == [("22 + 48", 70.0, 70.0)]


def _write(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=["prompt", "big", "small", "big_response", "small_response"])
        w.writeheader()
        w.writerows(rows)
    return path


def _row(i, small_ok, big_ok, small_answer):
    return {"prompt": f"question {i}?", "big": str(big_ok), "small": str(small_ok),
            "big_response": "B" * 10, "small_response": small_answer}


def test_the_less_accurate_model_is_the_weak_one(tmp_path):
    path = _write(tmp_path / "d.csv", [_row(0, False, True, "x"), _row(1, True, True, "y")])
    ds = load_dataset(path)
    assert (ds.weak_model, ds.strong_model) == ("small", "big")
    assert ds.questions[0].weak_answer == "x" and ds.questions[0].weak_correct is False
    with pytest.raises(DatasetError, match="models found: big, small"):
        load_dataset(path, weak_model="tiny", strong_model="big")


def test_a_bad_correctness_flag_is_refused(tmp_path):
    path = _write(tmp_path / "d.csv", [{**_row(0, False, True, "x"), "big": "maybe"}])
    with pytest.raises(DatasetError, match="expected True or False, got 'maybe'"):
        load_dataset(path)


# One token of the small model costs 1 USD, of the big one 20.
BOOK = PriceBook({"small": HostedPrice(1e6, 1e6), "big": HostedPrice(20e6, 20e6)})


def test_every_policy_entry_and_the_cost_formula_on_a_small_dataset(tmp_path):
    rows = [_row(i, i % 3 != 0, True, "#### 1" if i % 2 == 0 else "no") for i in range(12)]
    ds = load_dataset(_write(tmp_path / "d.csv", rows))
    tune, test = split_halves(ds.questions, seed=0)
    judge = RegexJudge(r"^#### \d+$", name="format")
    policies = evaluate_policies(ds, tune, test, BOOK, {"format": judge})
    assert set(policies) == {"always_weak", "always_strong", "random", "format"}
    weak_acc = sum(q.weak_correct for q in test) / len(test)
    assert (policies["always_weak"]["accuracy"], policies["always_weak"]["strong_share"]) == (weak_acc, 0.0)
    assert policies["always_strong"]["accuracy"] == 1.0
    c_s = [token_counts(q)[0] + token_counts(q)[1] for q in test]        # 1 USD per small token
    c_l = [20 * (token_counts(q)[0] + token_counts(q)[2]) for q in test]  # 20 USD per big token
    assert policies["always_weak"]["cost"] == pytest.approx(sum(c_s) / len(test))
    fmt = policies["format"]
    escalated = [q.weak_answer != "#### 1" for q in test]
    assert fmt["strong_share"] == pytest.approx(sum(escalated) / len(test))
    measured = sum(cs + (cl if e else 0) for cs, cl, e in zip(c_s, c_l, escalated)) / len(test)
    assert fmt["cost"] == pytest.approx(measured)
    assert fmt["expected_cost"]["formula"] == pytest.approx(measured)  # c_s + (1 - p) c_l, c_l of the escalated
    assert policies["random"]["strong_share"] == fmt["strong_share"] and policies["random"]["apgr"] == 0.5
    assert set(fmt) >= {"accuracy", "strong_share", "cost", "apgr", "cpt50", "cpt80", "threshold", "curve"}


def test_the_gsm8k_judges_beat_random_routing_on_the_held_out_half():
    summary = run_offline(DATASET, seed=0)
    policies, test = summary["policies"], summary["test"]
    assert (summary["split"]["tune"], summary["split"]["test"]) == (659, 660)
    for name in ("format", "arithmetic", "format+arithmetic"):
        e = policies[name]
        assert e["apgr"] > 0.5 and e["pgr"] > e["strong_share"], name
        assert e["expected_cost"]["formula"] == pytest.approx(e["cost"])
        assert e["accuracy"] > policies["random"]["by_judge"][name]["accuracy"]
    assert policies["always_weak"]["accuracy"] == test["weak_accuracy"]
    assert set(summary["excluded_judges"]) == {"logprob", "llm"}


async def test_the_http_verifier_serves_the_offline_judges_score():
    import contextlib

    from aiohttp import web

    from bench.cascade_eval.arithmetic import verifier_app
    from router.virtual_models.judges.verdict import Candidate
    from router.virtual_models.judges.verifier import VerifierJudge
    from router.virtual_models.scoring_http import ScoringEndpoint
    from tests.support import free_port

    ds = load_dataset(DATASET)
    sample = [q for q in ds.questions[:200] if arithmetic_score(q.weak_answer) < 1][:3] + list(ds.questions[:3])
    runner = web.AppRunner(verifier_app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    endpoint = ScoringEndpoint(f"http://127.0.0.1:{port}/verify", timeout_s=5.0)
    with contextlib.ExitStack():
        try:
            for q in sample:
                cand = Candidate(q.prompt, q.weak_answer, ds.weak_model)
                over_http = await VerifierJudge(endpoint, threshold=1.0).judge(cand)
                offline = await ArithmeticJudge().judge(cand)
                assert (over_http.score, over_http.accept) == (offline.score, offline.accept)
        finally:
            await endpoint.close()
            await runner.cleanup()
    assert any(arithmetic_score(q.weak_answer) < 1 for q in sample)


def test_prefixlb_bench_cascade_offline_writes_summary_report_and_curve(tmp_path, capsys):
    rows = [_row(i, i % 3 != 0, i % 5 != 0, "#### 1" if i % 2 == 0 else "9 * 2 = 19") for i in range(20)]
    data = _write(tmp_path / "d.csv", rows)
    book = tmp_path / "book.yaml"
    book.write_text("models:\n  small: {input_per_mtok: 1, output_per_mtok: 1}\n"
                    "  big: {input_per_mtok: 20, output_per_mtok: 20}\n")
    done = subprocess.run([sys.executable, "-m", "prefixlb", "bench", "cascade", "--dataset", str(data),
                           "--price-book", str(book), "--out", str(tmp_path / "out"), "--offline"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert set(summary["policies"]) == {"always_weak", "always_strong", "random", *gsm8k_judges()}
    for entry in summary["policies"].values():
        assert {"accuracy", "strong_share", "cost"} <= set(entry)
    assert all("apgr" in summary["policies"][j] for j in gsm8k_judges())
    assert (tmp_path / "out/curve.png").stat().st_size > 1000
    assert "| format+arithmetic |" in (tmp_path / "out/report.md").read_text()
    from prefixlb.cli import main

    assert main(["bench", "cascade", "--dataset", str(data), "--out", str(tmp_path / "o2")]) == 2
    assert "has no entry for 'small'" in capsys.readouterr().err
