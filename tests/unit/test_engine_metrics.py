"""A vLLM or SGLang server's Prometheus text turned into the LoadReport the policy reads.

The vLLM samples are real (tests/data/capture_vllm_samples.py: vLLM 0.32, 16 blocks of 128
tokens); the SGLang one is written from SGLang's source (tests/data/sglang_metrics.txt says so).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from router.fleet.engine_metrics import (SGLANG, VLLM, EngineMetricsError, EngineScrape, decode_step_s,
                                         detect_kind, load_report, parse_engine_metrics, prefill_tokens_per_s)

DATA = Path(__file__).resolve().parent.parent / "data"


def _read(name: str) -> str:
    return (DATA / name).read_text()


def test_an_idle_vllm_scrape_reads_its_pool_model_and_zero_load():
    s = parse_engine_metrics(_read("vllm_metrics_idle.txt"), ts=100.0)
    assert (s.kind, s.running, s.waiting, s.kv_usage) == (VLLM, 0, 0, 0.0)
    assert (s.block_size, s.total_blocks, s.capacity_tokens, s.models) == (128, 16, 2048, ("tiny",))
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.cached_prompt_tokens_total) == (0.0, 0.0, 0.0)
    assert (s.lora_running, s.lora_waiting, s.max_lora) == ((), (), None)


def test_a_busy_vllm_scrape_reports_its_running_and_waiting_requests_and_kv_usage():
    s = parse_engine_metrics(_read("vllm_metrics_busy.txt"), ts=101.0)
    assert s.running + s.waiting == 4 and s.running >= 1
    assert 0.0 < s.kv_usage <= 1.0


def test_two_vllm_scrapes_give_measured_prefill_speed_and_decode_step():
    idle = parse_engine_metrics(_read("vllm_metrics_idle.txt"), ts=100.0)
    after = parse_engine_metrics(_read("vllm_metrics_after.txt"), ts=160.0)
    prefill_tokens = after.prefill_computed_tokens_sum - idle.prefill_computed_tokens_sum
    prefill_time = after.prefill_time_sum - idle.prefill_time_sum
    assert prefill_tokens > 0 and prefill_time > 0
    assert prefill_tokens_per_s(idle, after) == pytest.approx(prefill_tokens / prefill_time)
    itl = (after.inter_token_latency_sum - idle.inter_token_latency_sum) / (
        after.inter_token_latency_count - idle.inter_token_latency_count)
    assert decode_step_s(idle, after) == pytest.approx(itl) and 0 < itl < 1
    report = load_report("vllm-a", after, idle)
    assert (report.worker_id, report.running, report.waiting, report.block_size, report.total_blocks,
            report.capacity_tokens, report.ts) == ("vllm-a", 0, 0, 128, 16, 2048, 160.0)
    assert report.prefill_tokens_per_s == pytest.approx(prefill_tokens / prefill_time)
    assert report.decode_step_s == pytest.approx(itl)


def test_without_a_previous_scrape_or_after_a_restart_speeds_are_unmeasured():
    idle = parse_engine_metrics(_read("vllm_metrics_idle.txt"), ts=100.0)
    after = parse_engine_metrics(_read("vllm_metrics_after.txt"), ts=160.0)
    assert (load_report("v", after).prefill_tokens_per_s, load_report("v", after).decode_step_s) == (0.0, 0.0)
    restarted = load_report("v", idle, after)  # counters went backwards: the engine restarted
    assert (restarted.prefill_tokens_per_s, restarted.decode_step_s, restarted.queued_prefill_tokens) == (0.0, 0.0, 0)


def test_queued_prefill_is_waiting_requests_times_the_mean_prompt_length():
    base = dict(kind=VLLM, running=2, kv_usage=0.5, block_size=128, total_blocks=100)
    prev = EngineScrape(ts=0.0, waiting=0, prompt_tokens_total=1000.0, prompt_requests_count=10.0, **base)
    cur = EngineScrape(ts=2.0, waiting=3, prompt_tokens_total=3000.0, prompt_requests_count=20.0, **base)
    report = load_report("v", cur, prev)
    assert (report.queued_prefill_tokens, report.free_blocks, report.running_tokens) == (600, 50, 50 * 128)
    quiet = EngineScrape(ts=4.0, waiting=3, prompt_tokens_total=3000.0, prompt_requests_count=20.0, **base)
    assert load_report("v", quiet, cur, mean_prompt=150.0).queued_prefill_tokens == 450


def test_vllm_lora_requests_info_names_the_running_and_waiting_adapters_of_the_newest_sample():
    text = _read("vllm_metrics_idle.txt") + (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b",waiting_lora_adapters="c"} 1.8e9\n')
    s = parse_engine_metrics(text, ts=0.0)
    assert (s.lora_running, s.lora_waiting, s.max_lora) == (("b",), ("c",), 4)


def test_an_sglang_scrape_counts_tensor_parallel_rank_0_and_sums_data_parallel_ranks():
    text = _read("sglang_metrics.txt")
    assert detect_kind(text) == SGLANG
    s = parse_engine_metrics(text, ts=10.0)
    assert (s.kind, s.running, s.waiting, s.kv_usage) == (SGLANG, 5, 5, 0.25)
    assert (s.block_size, s.capacity_tokens, s.models) == (1, 163840, ("tiny",))
    assert (s.prompt_tokens_total, s.cached_prompt_tokens_total, s.generation_tokens_total) == (120000.0, 40000.0, 64000.0)
    assert (s.inter_token_latency_sum, s.inter_token_latency_count) == (945.0, 63000.0)


def test_sglang_prefill_speed_is_computed_tokens_over_wall_time_only_while_busy():
    text = _read("sglang_metrics.txt")
    prev = parse_engine_metrics(text, ts=10.0)
    grown = (text.replace("sglang:prompt_tokens_total{model_name=\"tiny\"} 120000.0",
                          "sglang:prompt_tokens_total{model_name=\"tiny\"} 130000.0")
             .replace("sglang:cached_tokens_total{model_name=\"tiny\"} 40000.0",
                      "sglang:cached_tokens_total{model_name=\"tiny\"} 42000.0")
             .replace("_count{model_name=\"tiny\"} 63000.0", "_count{model_name=\"tiny\"} 64000.0")
             .replace("_sum{model_name=\"tiny\"} 945.0", "_sum{model_name=\"tiny\"} 965.0"))
    cur = parse_engine_metrics(grown, ts=12.0)
    assert prefill_tokens_per_s(prev, cur) == pytest.approx((10000 - 2000) / 2.0)
    assert decode_step_s(prev, cur) == pytest.approx(20.0 / 1000)
    idle = parse_engine_metrics(grown.replace('tp_rank="0"} 3.0', 'tp_rank="0"} 0.0')
                                .replace('tp_rank="0"} 2.0', 'tp_rank="0"} 0.0'), ts=12.0)
    assert idle.running == 0 and prefill_tokens_per_s(prev, idle) == 0.0


@pytest.mark.parametrize("text, message", [
    ("vllm:num_requests_running{model_name=\"m\" 3\n", "not Prometheus"),
    ("http_requests_total 3\n", "neither"),
    ("", "neither"),
])
def test_text_that_is_not_an_engines_metrics_is_refused(text, message):
    with pytest.raises(EngineMetricsError, match=message):
        parse_engine_metrics(text, ts=0.0)


def test_out_of_range_gauges_are_clamped():
    s = parse_engine_metrics('vllm:num_requests_running{model_name="m"} -3\n'
                             'vllm:num_requests_waiting{model_name="m"} NaN\n'
                             'vllm:kv_cache_usage_perc{model_name="m"} 7\n', ts=0.0)
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 1.0)
