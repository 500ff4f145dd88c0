"""The simulated runner: a batch's latency-model shape, deterministic tokens, the virtual clock."""
from __future__ import annotations

import pytest

from worker.engine.runner import ScheduledBatch, ScheduledSequence
from worker.engine.sampling_params import SamplingParams
from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.profiles import get_gpu, get_model
from worker.simulator.runner import SIM_TEXT, SimulatedRunner, VirtualClock, build_simulated_engine, nominal_speed
from worker.engine.stats import prefill_work


class FakeTime:
    """A clock the test moves by hand; ``sleep`` advances it and records the request."""

    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def _seq(rid: str, computed: int, scheduled: int, prefill: bool, samples: bool, outputs: int = 0,
         logprobs: int | None = None) -> ScheduledSequence:
    return ScheduledSequence(rid, [1] * scheduled, computed, scheduled, [], prefill, samples,
                             SamplingParams(max_tokens=64, logprobs=logprobs), 10, outputs)


@pytest.fixture
def runner() -> SimulatedRunner:
    latency = LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"))
    return SimulatedRunner(latency, output_len=8, clock=VirtualClock(10.0, now=FakeTime().now, sleep=lambda s: None))


def test_a_batch_becomes_the_latency_models_step_shape(runner):
    batch = ScheduledBatch([_seq("a", 100, 50, True, False), _seq("b", 200, 1, False, True)])
    expected = StepShape()
    expected.add_prefill(50, 100, samples=False)
    expected.add_decode(201)
    assert runner.shape(batch) == expected


def test_tokens_follow_the_fixed_text_then_eos_unless_ignored(runner):
    assert [runner.token_for(i) for i in range(8)] == [*SIM_TEXT[:7], 257]
    assert [runner.token_for(i, ignore_eos=True) for i in range(9)] == list(SIM_TEXT[:9])


def test_only_sampling_sequences_get_a_token_and_logprobs_put_all_mass_on_it(runner):
    batch = ScheduledBatch([_seq("a", 0, 50, True, False), _seq("b", 60, 1, False, True, outputs=2, logprobs=3)])
    out = runner.execute(batch)
    assert out.sampled_token_ids == {"b": SIM_TEXT[2]}
    lp = out.logprobs["b"]
    assert (lp.token_id, lp.logprob) == (SIM_TEXT[2], 0.0)
    assert lp.top == [(SIM_TEXT[2], 0.0), (SIM_TEXT[2] + 1, -9999.0), (SIM_TEXT[2] + 2, -9999.0)]


def test_virtual_clock_schedules_back_to_back_steps_without_drift():
    ft = FakeTime()
    clock = VirtualClock(time_scale=10.0, now=ft.now, sleep=ft.sleep)
    clock.advance(1.0)        # ends at 100.1
    ft.t += 0.02              # 20 ms of host overhead between steps
    clock.advance(1.0)        # still ends at 100.2: the overhead is absorbed, not added
    assert ft.t == pytest.approx(100.2)
    assert ft.sleeps == pytest.approx([0.1, 0.08])
    assert clock.modelled_s == 2.0


def test_virtual_clock_restarts_from_now_after_an_idle_gap():
    ft = FakeTime()
    clock = VirtualClock(time_scale=1.0, now=ft.now, sleep=ft.sleep, idle_gap_s=0.05)
    clock.advance(0.01)
    ft.t += 5.0               # idle: no catch-up burst afterwards
    clock.advance(0.01)
    assert ft.sleeps == pytest.approx([0.01, 0.01])


def test_virtual_clock_measures_how_far_a_busy_host_falls_behind_and_catches_up():
    ft = FakeTime()
    clock = VirtualClock(time_scale=10.0, now=ft.now, sleep=ft.sleep, idle_gap_s=0.05)
    clock.advance(1.0)                      # scheduled to end at 100.1 (wall)
    ft.t += 0.3                             # the host took 300 ms more than the step's 100 ms
    clock.advance(1.0, continuing=True)     # same work going on: late by 0.3 s wall = 3 s modelled
    assert clock.behind_s == pytest.approx(3.0)
    assert ft.sleeps == pytest.approx([0.1])  # no sleep: the clock catches up instead of resetting
    ft.t = 100.15                           # host caught up (wall before the next scheduled end, 100.2)
    clock.advance(1.0, continuing=True)
    assert clock.behind_s == 0.0
    assert clock.behind_max_s == pytest.approx(3.0)
    ft.t += 10.0                            # idle: no lateness, the clock restarts from now
    clock.advance(1.0)
    assert (clock.behind_s, clock.behind_max_s) == (0.0, pytest.approx(3.0))


def test_simulated_engine_takes_capacity_from_the_profile_unless_overridden():
    engine, runner = build_simulated_engine("H100-80G", "llama-3-8b")
    assert engine.num_kv_blocks == 28_531
    assert engine.max_model_len == 131_072
    small, _ = build_simulated_engine("H100-80G", "llama-3-8b", num_kv_blocks=100)
    assert small.num_kv_blocks == 100
    # 1 GiB of KV per GPU at 128 KiB per token = 8,192 tokens = 512 blocks.
    gib, _ = build_simulated_engine("H100-80G", "llama-3-8b", kv_memory_bytes=2**30)
    assert gib.num_kv_blocks == 512
    seventy, r70 = build_simulated_engine("H200", "llama-3-70b")
    assert r70.latency.tp == 2


def test_the_simulated_engine_serves_prefix_hits_from_its_real_block_pool():
    engine, runner = build_simulated_engine("H100-80G", "llama-3-8b", time_scale=1e6, num_kv_blocks=64)
    prompt = list(range(100))
    params = SamplingParams(max_tokens=3, temperature=0.0)
    cold = engine.generate([prompt], params)[0]
    warm = engine.generate([prompt], params)[0]
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 96)
    assert cold.token_ids == warm.token_ids == list(SIM_TEXT[:3])


def test_a_step_reports_its_modelled_time_over_the_time_scale_whatever_the_wall_clock_did(runner):
    # The fake clock never moves: a step whose sleep the virtual clock skipped (the engine fell
    # behind) took no wall time, yet it must be reported as the modelled step.
    batch = ScheduledBatch([_seq("a", 0, 2048, True, True)])
    out = runner.execute(batch)
    assert out.step_s == pytest.approx(runner.latency.step_time(runner.shape(batch)) / 10.0)


def test_the_simulated_engine_measures_its_speed_on_modelled_time_in_the_routers_units():
    engine, runner = build_simulated_engine("H100-80G", "llama-3-8b", time_scale=1e6, num_kv_blocks=1024)
    nominal, _ = nominal_speed(runner.latency)
    assert engine.stats().prefill_tokens_per_s == pytest.approx(nominal * 1e6)
    engine.generate([[i % 256 for i in range(4000)]], SamplingParams(max_tokens=2, temperature=0.0))
    shape = StepShape()
    shape.add_prefill(4000, 0, samples=True)
    step_s = runner.latency.step_time(shape) / 1e6
    assert engine.stats().prefill_tokens_per_s == pytest.approx(prefill_work([(4000, 0)]) / step_s)
