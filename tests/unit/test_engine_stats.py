"""SpeedMeter: the measured prefill throughput and decode step time a router plans with."""
from __future__ import annotations

import pytest

from worker.stats import SpeedMeter


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
