"""SpeedMeter: the measured prefill throughput and decode step time a router plans with."""
from __future__ import annotations

import pytest

from worker.engine.stats import SpeedMeter, engine_speed_meter, prefill_work


def test_defaults_are_reported_until_a_step_is_measured():
    m = SpeedMeter(prefill_tokens_per_s=1000.0, decode_step_s=0.05)
    assert (m.prefill_tokens_per_s, m.decode_step_s) == (1000.0, 0.05)
    assert not m.prefill_measured and not m.decode_measured


def test_the_first_measurement_replaces_the_default_and_later_ones_are_averaged():
    m = SpeedMeter(1000.0, 0.05, alpha=0.5)
    m.observe(0.02, prefill_tokens=0, decode_seqs=4)
    assert m.decode_step_s == 0.02
    m.observe(0.04, prefill_tokens=0, decode_seqs=4)
    assert m.decode_step_s == pytest.approx(0.03)
    m.observe(0.5, prefill_tokens=1000, decode_seqs=0)
    assert m.prefill_tokens_per_s == 2000.0
    m.observe(0.25, prefill_tokens=1000, decode_seqs=0)
    assert m.prefill_tokens_per_s == pytest.approx(3000.0)


def test_a_mixed_step_charges_the_decode_estimate_before_computing_prefill_speed():
    m = SpeedMeter(1000.0, 0.1, alpha=1.0)
    m.observe(0.6, prefill_tokens=1000, decode_seqs=3)
    assert m.prefill_tokens_per_s == pytest.approx(1000 / 0.5)
    # The decode share never exceeds half the step.
    m.observe(0.1, prefill_tokens=100, decode_seqs=3)
    assert m.prefill_tokens_per_s == pytest.approx(100 / 0.05)


def test_small_prefill_chunks_do_not_move_the_prefill_estimate():
    m = SpeedMeter(1000.0, 0.05)
    m.observe(1.0, prefill_tokens=10, decode_seqs=0)
    assert m.prefill_tokens_per_s == 1000.0 and not m.prefill_measured


def test_a_stalled_step_moves_the_estimate_by_a_bounded_factor_only():
    # A process stopped for 0.8 s mid-step (SIGSTOP, swapping) must not make it look 500x slower.
    m = SpeedMeter(1000.0, 0.05, alpha=0.5, max_jump=10.0)
    m.observe(0.0015, prefill_tokens=0, decode_seqs=4)
    m.observe(0.78, prefill_tokens=0, decode_seqs=4)
    assert m.decode_step_s == pytest.approx((0.0015 + 0.015) / 2)
    m.observe(0.1, prefill_tokens=1000, decode_seqs=0)
    m.observe(100.0, prefill_tokens=1000, decode_seqs=0)
    assert m.prefill_tokens_per_s == pytest.approx((10_000 + 1_000) / 2)


def test_prefill_work_weights_each_new_token_by_its_attention_context():
    # 1,000 new tokens over 3,000 computed, knee 4,000: 1,000 x (1 + (3,000 + 500) / 4,000).
    assert prefill_work([(1000, 3000)], knee=4000.0) == pytest.approx(1875.0)
    assert prefill_work([(1000, 3000), (200, 0)], knee=4000.0) == pytest.approx(1875.0 + 200 * 1.025)
    assert prefill_work([]) == 0.0


def test_identical_workers_report_the_same_speed_whatever_context_lengths_they_served():
    # A GPU whose prefill time is its attention-weighted work / 10,000 per second. One worker
    # served short cold prompts, the other long suffixes after long cached prefixes: measured in
    # plain tokens they would report 9,846 vs 4,638 tokens/s; in work both report 10,000.
    short, long = SpeedMeter(1.0, 0.05, alpha=1.0), SpeedMeter(1.0, 0.05, alpha=1.0)
    for meter, chunk in ((short, (1000, 0)), (long, (4000, 30000))):
        work = prefill_work([chunk])
        meter.observe(work / 10_000, prefill_tokens=chunk[0], decode_seqs=0, prefill_work=work)
    assert short.prefill_tokens_per_s == pytest.approx(10_000.0)
    assert long.prefill_tokens_per_s == pytest.approx(10_000.0)


def test_a_short_prefill_riding_a_decode_batch_is_charged_its_budget_share_of_a_decode_step():
    # The router charges a full step's budget (2,000 tokens) one decode step (0.1 s); a step
    # prefilling 1,000 tokens beside decodes is charged half of it: 1,000 / (0.3 - 0.05).
    m = SpeedMeter(1000.0, 0.1, alpha=1.0, step_tokens=2000)
    m.observe(0.3, prefill_tokens=1000, decode_seqs=4)
    assert m.prefill_tokens_per_s == pytest.approx(4000.0)


def test_an_engine_meter_skips_prefill_steps_under_a_32nd_of_its_budget():
    assert engine_speed_meter(1000.0, 0.05, 8192).min_prefill_tokens == 256
    assert engine_speed_meter(1000.0, 0.05, 512).min_prefill_tokens == 32
    m = engine_speed_meter(1000.0, 0.05, 8192)
    m.observe(0.01, prefill_tokens=200, decode_seqs=0)
    assert not m.prefill_measured
    m.observe(0.1, prefill_tokens=256, decode_seqs=0)
    assert m.prefill_tokens_per_s == pytest.approx(2560.0)
