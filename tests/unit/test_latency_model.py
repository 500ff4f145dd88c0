"""The simulated worker's latency model against values computed by hand from the documented formula.

Constants for Llama-3-8B on one H100 (see worker/simulator/profiles.py):
  matmul params P_mm = 8.03e9 - 128256*4096 = 7,504,663,424;  LM head V*H = 525,336,576
  attention FLOPs per (query, key) pair = 4 * 32 layers * 4096 = 524,288
  KV bytes per token = 2 * 32 * 8 * 128 * 2 = 131,072;  weights = 16.06e9 bytes
  compute = 989e12 * 0.6 = 593.4e12 FLOP/s;  bandwidth = 3.35e12 * 0.75 = 2.5125e12 B/s
  per-step overhead 1 ms
"""
from __future__ import annotations

import pytest

from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.profiles import ProfileError, get_gpu, get_model

COMPUTE = 593.4e12
BANDWIDTH = 2.5125e12
WEIGHTS = 16.06e9


@pytest.fixture
def h100_8b() -> LatencyModel:
    return LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"))


def test_kv_bytes_per_token_of_the_llama_shapes():
    assert get_model("llama-3-8b").kv_bytes_per_token == 131_072
    assert get_model("llama-3-70b").kv_bytes_per_token == 327_680


def test_cold_prefill_is_compute_bound(h100_8b):
    # 1000 new tokens, nothing cached: pairs = 1000*1001/2 = 500,500.
    flops = 2 * 7_504_663_424 * 1000 + 2 * 525_336_576 + 524_288 * 500_500
    assert flops == 15_272_783_665_152
    assert h100_8b.prefill_time(1000) == pytest.approx(0.001 + flops / COMPUTE, rel=1e-12)
    assert h100_8b.prefill_time(1000) == pytest.approx(0.0267378, abs=1e-7)


def test_short_suffix_after_a_long_cached_prefix_is_bandwidth_bound(h100_8b):
    # 100 new after 1900 cached: compute 1.604e12 FLOP = 2.7 ms < memory (weights + 2000 KV tokens).
    flops = 2 * 7_504_663_424 * 100 + 2 * 525_336_576 + 524_288 * (100 * 1900 + 5050)
    assert flops / COMPUTE < 0.0028
    expected = 0.001 + (WEIGHTS + 131_072 * 2000) / BANDWIDTH
    assert h100_8b.prefill_time(100, 1900) == pytest.approx(expected, rel=1e-12)
    assert h100_8b.prefill_time(100, 1900) < 0.3 * h100_8b.prefill_time(2000)


def test_decode_step_is_weights_plus_batch_kv_over_bandwidth(h100_8b):
    assert h100_8b.decode_step_time(1, 1024) == pytest.approx(
        0.001 + (WEIGHTS + 131_072 * 1024) / BANDWIDTH, rel=1e-12)
    assert h100_8b.decode_step_time(256, 1024) == pytest.approx(
        0.001 + (WEIGHTS + 256 * 131_072 * 1024) / BANDWIDTH, rel=1e-12)
    assert h100_8b.decode_step_time(256, 1024) == pytest.approx(0.0210676, abs=1e-7)


def test_large_decode_batches_become_compute_bound(h100_8b):
    # 4096 sequences of 16 tokens: FLOPs 4096*(2*P_mm + 2*V*H + 524288*16) over compute wins.
    flops = 4096 * (2 * 7_504_663_424 + 2 * 525_336_576 + 524_288 * 16)
    assert h100_8b.decode_step_time(4096, 16) == pytest.approx(0.001 + flops / COMPUTE, rel=1e-12)


def test_a_mixed_step_costs_the_maximum_not_the_sum(h100_8b):
    shape = StepShape()
    shape.add_prefill(1000, 0, samples=True)
    for _ in range(8):
        shape.add_decode(512)
    flops = (2 * 7_504_663_424 * 1008 + 2 * 525_336_576 * 9
             + 524_288 * (500_500 + 8 * 512))
    memory = (WEIGHTS + 131_072 * (1000 + 8 * 512)) / BANDWIDTH
    assert h100_8b.step_time(shape) == pytest.approx(0.001 + max(flops / COMPUTE, memory), rel=1e-12)
    assert h100_8b.step_time(shape) < h100_8b.prefill_time(1000) + h100_8b.decode_step_time(8, 512)


def test_a_chunk_that_does_not_finish_its_prompt_samples_no_logits(h100_8b):
    sampled, unsampled = StepShape(), StepShape()
    sampled.add_prefill(512, 0, samples=True)
    unsampled.add_prefill(512, 0, samples=False)
    diff = (h100_8b.step_time(sampled) - h100_8b.step_time(unsampled)) * COMPUTE
    assert diff == pytest.approx(2 * 525_336_576, rel=1e-6)


def test_empty_step_takes_no_time(h100_8b):
    assert h100_8b.step_time(StepShape()) == 0.0


def test_kv_capacity_is_memory_left_after_weights_in_tokens_and_blocks(h100_8b):
    tokens = int((81559 * 2**20 * 0.9 - WEIGHTS - 2**30) // 131_072)
    assert tokens == 456_504
    assert h100_8b.kv_capacity_tokens() == tokens
    assert h100_8b.kv_capacity_blocks(16) == tokens // 16 == 28_531


def test_70b_needs_tensor_parallelism_and_tp_divides_weights_and_kv():
    model = get_model("llama-3-70b")
    assert LatencyModel(get_gpu("H100-80G"), model).tp == 4
    assert LatencyModel(get_gpu("A100-80G"), model).tp == 4
    h200 = LatencyModel(get_gpu("H200"), model)
    assert h200.tp == 2
    per_gpu_free = 143771 * 2**20 * 0.9 - 70.6e9 * 2 / 2 - 2**30
    assert h200.kv_capacity_tokens() == int(per_gpu_free // (327_680 / 2))
    with pytest.raises(ProfileError, match="does not fit on 1 x H100-80G"):
        LatencyModel(get_gpu("H100-80G"), model, tp=1)


def test_tensor_parallelism_divides_step_time():
    one = LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"), tp=1, step_overhead_s=0.0)
    two = LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b"), tp=2, step_overhead_s=0.0)
    assert two.prefill_time(4096) == pytest.approx(one.prefill_time(4096) / 2, rel=1e-12)


def test_profiles_are_looked_up_by_name_case_insensitively():
    assert get_gpu("h200").hbm_bandwidth == 4.8e12
    assert get_gpu("A100-80G").peak_flops == 312e12
    with pytest.raises(ProfileError, match="known: A100-80G, H100-80G, H200"):
        get_gpu("TPU")
    with pytest.raises(ProfileError, match="known: llama-3-8b, llama-3-70b"):
        get_model("gpt-5")


def test_nominal_speed_is_a_cold_2k_prefill_and_a_batch_one_decode(h100_8b):
    prefill_tps, decode_s = h100_8b.nominal_speed()
    assert prefill_tps == pytest.approx(2048 / h100_8b.prefill_time(2048))
    assert decode_s == h100_8b.decode_step_time(1, 1024)
