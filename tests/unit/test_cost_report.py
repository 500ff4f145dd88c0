"""`prefixlb cost`: the walkthrough on a workload, traces without prefixes, run directories, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.cost.report import CostSourceError, analyse, cost_summary, write_cost_report
from bench.records import RequestRecord, write_jsonl
from bench.workloads import load_workload
from bench.workloads.base import RequestSpec, Workload
from router.cost.price_book import HostedPrice, PriceBook, SelfHostedPrice
from tests.support import ROOT

UNIT_BOOK = PriceBook({"unit": HostedPrice(1e6, 0.0, 0.1, 1.25, 2.0)}, "unit")  # 1 USD per input token


def _walkthrough(n=100, gap_s=1.0):
    # The source texts' 5.6.8: one 10,000-token prefix, a 200-token question each.
    return Workload("walkthrough", [RequestSpec(i, i * gap_s, ((1, 10_000), (100 + i, 200)), 1) for i in range(n)])


def test_the_report_reproduces_the_walkthrough_on_a_workload():
    summary = cost_summary([UNIT_BOOK], workload=_walkthrough(), block_tokens=10_000)
    five, hour = summary["models"][0]["ttl"]["5m"], summary["models"][0]["ttl"]["1h"]
    assert (five["no_cache_usd"], five["cost_usd"]) == (pytest.approx(1_020_000), pytest.approx(131_500))
    assert five["saved_fraction"] == pytest.approx(1 - 131_500 / 1_020_000)
    # The 1-hour write costs 2x: 20,000 + 200 + 99 x 1,200.
    assert hour["cost_usd"] == pytest.approx(139_000)
    assert (five["break_even_reads"], five["min_paying_reads"]) == (pytest.approx(0.25 / 0.9), 1)
    assert (hour["break_even_reads"], hour["min_paying_reads"]) == (pytest.approx(1 / 0.9), 2)
    assert (five["writes"], five["reads_per_write"]) == (1, 99.0)
    assert five["reuse_histogram"] == {"0": 0, "1": 0, "2-4": 0, "5-9": 0, "10-99": 1, "100+": 0}
    assert five["unpaid_writes"]["writes"] == 0
    assert five["top_saving_prefixes"][0]["net_saved_usd"] == pytest.approx(10_000 * (100 - (1.25 + 9.9)))


def test_a_prefix_read_once_pays_with_the_5_minute_ttl_but_not_with_the_hour():
    # Two requests, a 10,000-token prefix: one write, one read.
    summary = cost_summary([UNIT_BOOK], workload=_walkthrough(n=2), block_tokens=10_000)
    five, hour = summary["models"][0]["ttl"]["5m"], summary["models"][0]["ttl"]["1h"]
    assert five["unpaid_writes"]["writes"] == 0
    assert hour["unpaid_writes"] == {"writes": 1, "censored": 1, "tokens": 10_000,
                                     "loss_usd": pytest.approx(10_000 * (2.0 + 0.1 - 2))}
    assert hour["top_losing_prefixes"][0]["reads"] == 1


def test_writes_that_expire_unread_are_the_ones_that_did_not_pay():
    # Requests 10 minutes apart: every 5-minute write expires unread and loses its 0.25x premium.
    summary = cost_summary([UNIT_BOOK], workload=_walkthrough(n=3, gap_s=600), block_tokens=10_000)
    five = summary["models"][0]["ttl"]["5m"]
    assert five["unpaid_writes"] == {"writes": 3, "censored": 1, "tokens": 30_000,
                                     "loss_usd": pytest.approx(3 * 2_500)}
    assert five["saved_usd"] == pytest.approx(-7_500)


def test_a_self_hosted_model_reports_the_prefill_an_ideal_cache_saves():
    book = PriceBook({"m": SelfHostedPrice(usd_per_gpu_hour=3.6, prefill_tokens_per_s=1_000,
                                           attention_knee_tokens=1e12)}, "gpu")
    row = cost_summary([book], workload=_walkthrough(n=2), block_tokens=10_000)["models"][0]
    # With a linear prefill: the second request skips 10,000 tokens = 10 s at 0.001 USD/s.
    assert row["ideal_cache"]["saved_gpu_seconds"] == pytest.approx(10.0, rel=1e-6)
    assert row["ideal_cache"]["saved_usd"] == pytest.approx(0.01, rel=1e-6)


def test_a_trace_without_prefix_information_says_what_it_cannot_compute(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,1000,10\n2023-11-16 18:15:50.0000000,3000,30\n")
    summary = analyse(str(trace), [UNIT_BOOK])
    row = summary["models"][0]
    assert summary["prefix_information"] is False
    assert "no prefix information" in summary["notes"][0]
    assert "reuse_histogram" not in row["ttl"]["5m"] and row["ttl"]["5m"]["min_paying_reads"] == 1
    # What-if: a quarter of 4,000 input tokens read at 0.1x saves 900 USD.
    assert row["what_if"][0] == {"cached_share": 0.25, "saved_usd": pytest.approx(900.0),
                                 "saved_fraction": pytest.approx(900.0 / 4_000)}


def test_a_run_directory_is_priced_on_its_measured_cached_tokens_and_replayed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    workload = load_workload("doc-qa", 3, 12)
    records = [RequestRecord(index=r.index, sent_s=r.arrival_s, prompt_tokens=r.prompt_tokens + 1,
                             cached_tokens=8_192 if i >= 4 else 0, completion_tokens=r.max_tokens)
               for i, r in enumerate(workload.requests)]
    records.append(RequestRecord(index=99, sent_s=0.0, error="boom"))
    write_jsonl(records, run / "requests.jsonl")
    (run / "meta.json").write_text(json.dumps({"config": {"workload": "doc-qa", "seed": 3, "num_requests": 12}}))
    summary = analyse(str(run), [UNIT_BOOK])
    row = summary["models"][0]
    assert summary["source"]["kind"] == "run" and summary["prefix_information"] is True
    assert row["measured"]["cached_tokens"] == 8 * 8_192
    prompt = sum(r.prompt_tokens for r in records if r.ok)
    # Every uncached token is assumed written at 1.25x, every cached one read at 0.1x.
    assert row["measured"]["cost_usd"] == pytest.approx((prompt - 8 * 8_192) * 1.25 + 8 * 8_192 * 0.1)
    assert row["measured"]["no_cache_usd"] == pytest.approx(prompt)
    assert row["ttl"]["5m"]["writes"] > 0


def test_a_run_without_meta_reports_only_what_was_measured(tmp_path):
    write_jsonl([RequestRecord(index=0, sent_s=0.0, prompt_tokens=100, cached_tokens=50)], tmp_path / "requests.jsonl")
    summary = analyse(str(tmp_path), [UNIT_BOOK])
    assert "no meta.json" in summary["notes"][0]
    assert "ttl" not in summary["models"][0] and summary["models"][0]["measured"]["cached_tokens"] == 50


def test_unknown_sources_are_refused(tmp_path):
    (tmp_path / "trace.txt").write_text("x")
    with pytest.raises(CostSourceError, match="unknown trace format"):
        analyse(str(tmp_path / "trace.txt"), [UNIT_BOOK])
    with pytest.raises(CostSourceError, match="unknown workload"):
        analyse("no-such-workload", [UNIT_BOOK])
    with pytest.raises(CostSourceError, match="needs requests.jsonl"):
        analyse(str(tmp_path), [UNIT_BOOK])


def test_the_report_files_are_written(tmp_path):
    summary = cost_summary([UNIT_BOOK], workload=_walkthrough(n=3), block_tokens=10_000)
    write_cost_report(tmp_path, summary)
    assert json.loads((tmp_path / "summary.json").read_text())["models"][0]["ttl"]["5m"]["writes"] == 1
    text = (tmp_path / "report.md").read_text()
    for heading in ("## Break-even", "## Savings from caching", "## Reuse of each write", "## Writes that did not pay"):
        assert heading in text


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "prefixlb", "cost", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_prefixlb_cost_reads_a_mooncake_trace_with_the_example_price_book(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 4]},
            {"timestamp": 2000, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _cli(str(trace), "--price-book", str(ROOT / "docs/examples/price_book.yaml"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    large = next(m for m in summary["models"] if m["model"] == "hosted-large")
    # Blocks 1-2 (1,024 tokens) are written by the first request and read by the second; the third
    # prompt has one full block, 512 tokens, below the 1,024-token minimum: not cached.
    assert (large["ttl"]["5m"]["read_tokens"], large["ttl"]["5m"]["write_tokens"]) == (1_024, 1_024)
    gpu = next(m for m in summary["models"] if m["model"] == "llama-3-8b")
    assert gpu["kind"] == "self_hosted" and gpu["ideal_cache"]["saved_gpu_seconds"] > 0
    assert (tmp_path / "out/report.md").exists()


def test_prefixlb_cost_explains_a_bad_price_book(tmp_path):
    book = tmp_path / "book.yaml"
    book.write_text("models:\n  m:\n    input_per_mtok: 1\n")
    done = _cli("doc-qa", "--price-book", str(book), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "models.m: missing 'output_per_mtok'" in done.stderr
