"""The engine on a CUDA device with the Triton kernels agrees with transformers (GPU machines only).

The same scenarios as test_engine_parity.py (cold, warm, 8 concurrent, a pool small enough to
preempt), but the engine runs on ``cuda`` with ``attention_backend="triton"`` in float32 while
the reference stays transformers on CPU. Skipped where there is no CUDA device (CI); run on a
GPU machine with ``pytest tests/integration/test_engine_cuda.py``.
"""
from __future__ import annotations

import pytest
import torch

from tests.integration.test_engine_parity import TEXT, assert_exact_accounting, assert_matches_reference, run
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def cuda_engine(tiny_checkpoint, **kw) -> LLMEngine:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity, not TF32
    # A fixed pool: sized from the GPU's memory, the tiny model would get millions of blocks.
    kw.setdefault("num_kv_blocks", 4096)
    return LLMEngine(EngineConfig(model=str(tiny_checkpoint), device="cuda", attention_backend="triton", **kw))


def test_cuda_triton_engine_matches_transformers_cold_warm_and_concurrent(tiny_checkpoint, reference):
    engine = cuda_engine(tiny_checkpoint, max_num_batched_tokens=256)
    assert engine.runner.backend.name == "triton"
    prompt = engine.tokenizer.encode(TEXT)
    cold = run(engine, {"cold": prompt}, 24)["cold"]
    warm = run(engine, {"warm": prompt}, 24)["warm"]
    assert warm[-1].num_cached_tokens > 0
    assert assert_matches_reference(reference, prompt, cold) == assert_matches_reference(reference, prompt, warm)
    prompts = {f"r{i}": engine.tokenizer.encode(TEXT[: 20 + 37 * i] + f" #{i}") for i in range(8)}
    outs = run(engine, prompts, 16)
    for rid, p in prompts.items():
        assert_matches_reference(reference, p, outs[rid])
    assert_exact_accounting(engine)


def test_cuda_triton_engine_matches_transformers_under_preemption(tiny_checkpoint, reference):
    engine = cuda_engine(tiny_checkpoint, num_kv_blocks=24, max_num_batched_tokens=128)
    prompts = {f"r{i}": engine.tokenizer.encode(f"Request {i}: " + TEXT[i * 10: i * 10 + 90]) for i in range(4)}
    outs = run(engine, prompts, 40)
    assert engine.stats().num_preemptions > 0
    for rid, p in prompts.items():
        assert_matches_reference(reference, p, outs[rid])
    assert_exact_accounting(engine)


def test_cuda_engine_serves_bfloat16(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), device="cuda", dtype="bfloat16", num_kv_blocks=4096))
    prompt = engine.tokenizer.encode(TEXT)
    outs = engine.generate([prompt, prompt[:50]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [16, 16]
    assert all(o.finish_reason == "length" for o in outs)
