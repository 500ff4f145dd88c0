"""The CPU KV tier with the real torch model runner (the ``tiny`` preset, float32, CPU): KV copied
out to host memory and back gives the same greedy tokens and logprobs as a cold run."""
from __future__ import annotations

import pytest

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

A = [(7 * i + 3) % 250 + 1 for i in range(96)]  # 6 blocks of 16
B = [(11 * i + 5) % 250 + 1 for i in range(96)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", block_size=16, num_kv_blocks=8, max_num_batched_tokens=256,
                                  num_threads=1, **kw))


def test_a_prefix_loaded_back_from_the_tier_generates_what_a_cold_run_does():
    cold = _engine(enable_prefix_caching=False).generate([A], PARAMS)[0]
    engine = _engine(cpu_kv_blocks=16)
    engine.generate([A], PARAMS)
    engine.generate([B], PARAMS)  # A's blocks go down to the tier to make room
    warm = engine.generate([A], PARAMS)[0]
    assert warm.num_loaded_tokens > 0
    assert warm.num_cached_tokens == 80  # 5 blocks; the one holding the last prompt token is computed
    assert warm.token_ids == cold.token_ids
    for got, want in zip(warm.logprobs, cold.logprobs):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    tier = engine.stats().kv_tier
    assert tier.counters.bytes_loaded == warm.num_loaded_tokens // 16 * engine.runner.kv_block_bytes
    assert tier.load_measured and tier.load_bytes_per_s > 0


def test_the_torch_runner_sizes_the_tier_from_host_memory():
    engine = _engine(cpu_kv_memory_bytes=10 * 1024 * 1024)
    per_block = engine.runner.kv_block_bytes
    assert engine.kv_tier is not None and engine.kv_tier.host.num_blocks == 10 * 1024 * 1024 // per_block
    assert engine.runner.cpu_kv_caches[0][0].shape[0] == engine.kv_tier.host.num_blocks


def test_the_tier_benchmark_measures_a_load_against_a_cold_prefill():
    from bench.kv_tier import measure
    row = measure("tiny", 128, "cpu", threads=1)
    assert row["decision"] == "load" and row["loaded_tokens"] == 128 - 16
    assert row["kv_bytes"] == 8 * 32768  # 8 blocks of the tiny model's 32 KiB
    assert row["transfer_s"] > 0 and row["recompute_s"] > 0 and row["warm_ttft_s"] > 0
