"""The simulated worker's LoRA model: adapter size on the profile's shapes, the delta's cost in the
roofline, slot loads between steps and disk reads slept (scaled), through the real scheduler."""
from __future__ import annotations

import pytest

from tests.lora_support import ALL_TARGETS, write_adapter
from worker.engine.lora.adapter import LoRAAdapter
from worker.engine.runner import ScheduledBatch, ScheduledSequence
from worker.engine.sampling_params import SamplingParams
from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.profiles import get_gpu, get_model
from worker.simulator.runner import SimulatedRunner, VirtualClock, build_simulated_engine

H100 = get_gpu("H100-80G")
LLAMA_8B = get_model("llama-3-8b")


def adapter(name: str, rank: int, targets=ALL_TARGETS) -> LoRAAdapter:
    return LoRAAdapter(name=name, path="/x", digest=name * 8, rank=rank, scaling=1.0,
                       target_modules=tuple(targets), num_params=0, weights={})


def decode(rid: str, slot: int) -> ScheduledSequence:
    return ScheduledSequence(rid, [1], 1023, 1, [], False, True, SamplingParams(max_tokens=8), 1000, 23,
                             lora_slot=slot)


def test_an_adapters_size_follows_the_profiles_shapes():
    # Llama-3-8B: q 4096+4096, k and v 4096+1024, o 4096+4096, gate and up 4096+14336, down 14336+4096.
    assert LLAMA_8B.lora_params(16, ALL_TARGETS) == 32 * 16 * 81920
    assert LLAMA_8B.lora_params(8, ("q_proj", "v_proj")) == 32 * 8 * (8192 + 5120)


def test_distinct_adapters_in_a_decode_step_cost_their_weights_bandwidth_and_a_shared_one_costs_once():
    latency = LatencyModel(H100, LLAMA_8B)
    runner = SimulatedRunner(latency, clock=VirtualClock(1.0, sleep=lambda s: None))
    params = LLAMA_8B.lora_params(16, ALL_TARGETS)
    batch = ScheduledBatch([decode(f"r{i}", 1 + i) for i in range(32)],
                           lora_loads=[(1 + i, adapter(f"a{i}", 16)) for i in range(32)])
    runner.execute(batch)  # loads the 32 slots

    distinct = runner.shape(ScheduledBatch([decode(f"r{i}", 1 + i) for i in range(32)]))
    shared = runner.shape(ScheduledBatch([decode(f"r{i}", 1) for i in range(32)]))
    base = runner.shape(ScheduledBatch([decode(f"r{i}", 0) for i in range(32)]))

    assert distinct.lora_weight_bytes == 32 * params * 2 and shared.lora_weight_bytes == params * 2
    assert distinct.lora_token_params == shared.lora_token_params == 32 * params
    extra = latency.step_time(distinct) - latency.step_time(base)
    assert extra == pytest.approx(32 * params * 2 / latency.bytes_per_s)  # bandwidth-bound decode
    assert 0 < latency.step_time(shared) - latency.step_time(base) < extra / 20


def test_slot_loads_are_charged_to_the_step_that_needs_them_and_reported_apart():
    latency = LatencyModel(H100, LLAMA_8B)
    runner = SimulatedRunner(latency, time_scale=10.0, clock=VirtualClock(10.0, sleep=lambda s: None))
    a = adapter("a", 16)
    params = LLAMA_8B.lora_params(16, ALL_TARGETS)

    out = runner.execute(ScheduledBatch([decode("r", 1)], lora_loads=[(1, a)]))

    load_s = params * 2 / H100.host_to_device_bandwidth
    assert latency.lora_slot_load_time(params) == pytest.approx(load_s)
    assert out.lora_load_s == pytest.approx(load_s / 10.0)
    assert out.step_s == pytest.approx((latency.step_time(runner.shape(ScheduledBatch([decode("r", 1)]))) + load_s) / 10)


def test_the_simulated_engine_serves_adapters_and_sleeps_their_disk_reads(tmp_path):
    engine, runner = build_simulated_engine("H100-80G", "llama-3-8b", time_scale=1e6, num_kv_blocks=512,
                                            enable_lora=True, max_loras=1)
    slept: list[float] = []
    runner.clock.sleep = slept.append
    a = engine.add_lora("a", str(write_adapter(tmp_path / "a", rank=8, targets=("q_proj", "v_proj"))))
    b = engine.add_lora("b", str(write_adapter(tmp_path / "b", rank=8, targets=("q_proj", "v_proj"), seed=1)))
    params = LLAMA_8B.lora_params(8, ("q_proj", "v_proj"))
    assert slept[0] == pytest.approx(runner.latency.lora_disk_load_time(params) / 1e6)

    for rid, lora in (("a", a), ("b", b), ("base", None)):
        engine.add_request(rid, [1] * 40, SamplingParams(max_tokens=3, ignore_eos=True), lora=lora)
    while engine.has_unfinished_requests():
        engine.step()

    stats = engine.stats().lora
    assert (a.counters.slot_loads, b.counters.slot_loads, a.counters.slot_evictions) == (1, 1, 1)
    assert stats.gpu == ["b"] and stats.cpu == ["a"]
    load_a = runner.latency.lora_slot_load_time(params) / 1e6
    load_b = runner.latency.lora_slot_load_time(LLAMA_8B.lora_params(8, ("q_proj", "v_proj"))) / 1e6
    assert stats.slot_load_s == pytest.approx(0.7 * load_a + 0.3 * load_b)  # EMA: a's load, then b's


def test_step_shapes_without_adapters_are_unchanged():
    shape = StepShape()
    shape.add_decode(100)
    latency = LatencyModel(H100, LLAMA_8B)
    assert latency.bytes_moved(shape) == LLAMA_8B.weight_bytes + LLAMA_8B.kv_bytes_per_token * 100
