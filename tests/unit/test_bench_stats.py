"""The bench's statistics on a known small run: exact percentiles, hit rate, imbalance, keys."""
from __future__ import annotations

import json
import math

import pytest

from bench.records import RequestRecord, read_jsonl, write_jsonl
from bench.report import compare, write_run
from bench.stats import SUMMARY_KEYS, distribution, imbalance, percentile, rotated, summarize


def _known_run() -> list[RequestRecord]:
    # Four successful requests on two workers plus one failure; times chosen by hand.
    return [
        RequestRecord(0, sent_s=0.0, worker_id="w0", ttft_ms=100.0, e2e_ms=1000.0,
                      prompt_tokens=1000, cached_tokens=0, completion_tokens=10),
        RequestRecord(1, sent_s=1.0, worker_id="w0", ttft_ms=200.0, e2e_ms=1000.0,
                      prompt_tokens=1000, cached_tokens=800, completion_tokens=10),
        RequestRecord(2, sent_s=2.0, worker_id="w1", ttft_ms=300.0, e2e_ms=2000.0,
                      prompt_tokens=2000, cached_tokens=0, completion_tokens=20),
        RequestRecord(3, sent_s=3.0, worker_id="w1", ttft_ms=1300.0, e2e_ms=3000.0,
                      prompt_tokens=1000, cached_tokens=200, completion_tokens=20),
        RequestRecord(4, sent_s=3.5, error="http 503: no worker"),
    ]


def test_percentile_interpolates_linearly_between_the_closest_ranks():
    values = [100.0, 200.0, 300.0, 1300.0]
    assert percentile(values, 50) == 250.0          # halfway between ranks 1 and 2
    assert percentile(values, 90) == pytest.approx(1000.0)  # 300 + 0.7 * 1000
    assert percentile(values, 99) == pytest.approx(1270.0)  # 300 + 0.97 * 1000
    assert percentile(values, 0) == 100.0 and percentile(values, 100) == 1300.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_summary_of_a_known_run_has_exact_values():
    s = summarize(_known_run())
    assert tuple(s) == SUMMARY_KEYS
    assert s["requests"] == 5 and s["errors"] == 1
    assert s["prompt_tokens"] == 5000 and s["cached_tokens"] == 1000
    assert s["hit_rate"] == 0.2
    assert s["ttft_ms"] == {"p50": 250.0, "p90": pytest.approx(1000.0), "p99": pytest.approx(1270.0),
                            "mean": 475.0}
    assert s["e2e_ms"]["p50"] == 1500.0 and s["e2e_ms"]["mean"] == 1750.0
    # Makespan: first send at 0 s, last completion at 3 s + 3 s = 6 s.
    assert s["req_per_s"] == pytest.approx(4 / 6)
    assert s["output_tokens_per_s"] == pytest.approx(60 / 6)
    assert s["per_worker"] == {"w0": {"requests": 2, "prompt_tokens": 2000, "cached_tokens": 800},
                               "w1": {"requests": 2, "prompt_tokens": 3000, "cached_tokens": 200}}
    # Uncached work: w0 1200, w1 2800; mean 2000, max 2800.
    assert s["imbalance"] == pytest.approx(1.4)


def test_idle_workers_of_the_fleet_count_in_the_imbalance():
    s = summarize(_known_run(), fleet=["w0", "w1", "w2", "w3"])
    assert s["per_worker"]["w2"] == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
    assert s["imbalance"] == pytest.approx(2800 / 1000)  # mean over four workers is 1000


def test_imbalance_is_one_for_perfect_balance_and_for_no_work():
    assert imbalance([5, 5, 5]) == 1.0
    assert imbalance([0, 0]) == 1.0
    assert imbalance([3, 1]) == 1.5


def test_a_run_with_only_errors_summarises_without_crashing():
    s = summarize([RequestRecord(0, 0.0, error="boom")])
    assert s["errors"] == 1 and s["hit_rate"] == 0.0 and s["req_per_s"] == 0.0
    assert math.isnan(s["ttft_ms"]["p50"])
    assert all(math.isnan(v) for v in distribution([]).values())


def test_run_directory_round_trips_and_compare_lists_every_run(tmp_path):
    records = _known_run()
    write_run(tmp_path / "a", records, {"label": "alpha"})
    write_run(tmp_path / "b", records[:2], {"label": "beta"})
    assert read_jsonl(tmp_path / "a" / "requests.jsonl") == records
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert list(summary) == list(SUMMARY_KEYS)
    for name in ("report.md", "ttft_cdf.png", "hit_rate.png", "load_per_worker.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    text = compare([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")
    lines = text.splitlines()
    assert lines[2].startswith("| alpha | 5 | 1 | 0.200 | 0.250 |")
    assert lines[3].startswith("| beta | 2 | 0 | 0.400 | 0.150 |")
    assert (tmp_path / "cmp" / "ttft_cdf.png").stat().st_size > 0


def test_jsonl_writer_and_reader_agree(tmp_path):
    write_jsonl(_known_run(), tmp_path / "r.jsonl")
    assert read_jsonl(tmp_path / "r.jsonl")[4].error == "http 503: no worker"


def test_interleaved_rounds_put_each_target_first_in_turn():
    targets = ["direct", "prefixlb", "sglang"]
    orders = [rotated(targets, r) for r in range(4)]
    assert orders == [targets, ["prefixlb", "sglang", "direct"], ["sglang", "direct", "prefixlb"], targets]
    assert targets == ["direct", "prefixlb", "sglang"]  # (a new list each round, the input untouched)
