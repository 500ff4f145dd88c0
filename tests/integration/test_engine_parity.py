"""The engine agrees with transformers' LlamaForCausalLM on the very same saved weights.

The tiny preset is saved in Hugging Face format and loaded by transformers (float32, CPU). For
every scenario the reference runs teacher-forced on prompt + the engine's generated tokens, and
at every generated position we compare the engine's log-probabilities over the whole vocabulary
(``logprobs=vocab_size``: the logits up to the softmax normalisation) with the reference's
log_softmax, within ``ATOL``; the engine's greedy token must be the reference's argmax, except
where the reference's top-2 are closer than ``TIE_TOL`` (near-ties; counted and bounded): see
tests/parity_support.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.parity_support import ParityLog
from tests.parity_support import assert_matches_reference as check_reference
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.kv_cache import BlockRemoved
from worker.engine.sampling_params import SamplingParams

VOCAB = 258
PARITY = ParityLog()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def make_engine(tiny_checkpoint, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_checkpoint), **kw))


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=VOCAB)


def prompt_of(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def run(engine: LLMEngine, prompts: dict[str, list[int]], n: int):
    for rid, p in prompts.items():
        engine.add_request(rid, p, params(n))
    outs: dict[str, list] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def assert_matches_reference(reference, prompt: list[int], outs) -> list[int]:
    return check_reference(reference, prompt, outs, PARITY, VOCAB)


def assert_exact_accounting(engine: LLMEngine) -> None:
    pool = engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    s = engine.stats()
    assert s.free_blocks + s.cached_blocks + s.used_blocks == s.total_blocks and s.used_blocks == 0


TEXT = ("The router keeps a map of which worker holds which prefix. " * 4)


def test_cold_then_warm_prompt_match_transformers_and_each_other(tiny_checkpoint, reference):
    engine = make_engine(tiny_checkpoint)
    prompt = prompt_of(engine, TEXT)
    cold = run(engine, {"cold": prompt}, 24)["cold"]
    assert cold[-1].num_cached_tokens == 0
    cold_tokens = assert_matches_reference(reference, prompt, cold)
    warm = run(engine, {"warm": prompt}, 24)["warm"]
    # Every full block but the one holding the last prompt token is reused.
    assert warm[-1].num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert assert_matches_reference(reference, prompt, warm) == cold_tokens
    assert_exact_accounting(engine)


def test_a_prompt_sharing_a_long_prefix_reuses_it_and_matches(tiny_checkpoint, reference):
    engine = make_engine(tiny_checkpoint)
    first = prompt_of(engine, TEXT + "Question one?")
    run(engine, {"a": first}, 4)
    second = prompt_of(engine, TEXT + "A different question entirely.")
    outs = run(engine, {"b": second}, 20)["b"]
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert outs[-1].num_cached_tokens == shared // 16 * 16 > 0
    assert_matches_reference(reference, second, outs)
    assert_exact_accounting(engine)


def test_eight_concurrent_requests_of_mixed_lengths_each_match(tiny_checkpoint, reference):
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=256)
    texts = [TEXT[: 20 + 37 * i] + f" #{i}" for i in range(8)]
    prompts = {f"r{i}": prompt_of(engine, t) for i, t in enumerate(texts)}
    outs = run(engine, prompts, 16)
    for rid, prompt in prompts.items():
        assert_matches_reference(reference, prompt, outs[rid])
    assert_exact_accounting(engine)


def test_a_pool_small_enough_to_evict_and_preempt_still_matches(tiny_checkpoint, reference):
    # 24 blocks x 16 tokens: four ~100-token prompts growing by 40 tokens do not fit together.
    engine = make_engine(tiny_checkpoint, num_kv_blocks=24, max_num_batched_tokens=128)
    texts = [f"Request {i}: " + TEXT[i * 10: i * 10 + 90] for i in range(4)]
    prompts = {f"r{i}": prompt_of(engine, t) for i, t in enumerate(texts)}
    outs = run(engine, prompts, 40)
    assert engine.stats().num_preemptions > 0
    assert any(isinstance(e, BlockRemoved) for e in engine.take_kv_events())
    big = make_engine(tiny_checkpoint)
    roomy = run(big, prompts, 40)
    for rid, prompt in prompts.items():
        tokens = assert_matches_reference(reference, prompt, outs[rid])
        assert tokens == [t for o in roomy[rid] for t in o.new_token_ids]
    assert_exact_accounting(engine)


def test_near_ties_are_rare():
    # Runs last in this module, after the scenarios above compared ~350 positions (1 near-tie
    # at the time of writing, which the engine still decided like the reference).
    if PARITY.positions < 300:
        pytest.skip("counts near-ties over the whole module; run the module, not this test alone")
    assert len(PARITY.near_ties) <= 3, PARITY.near_ties
