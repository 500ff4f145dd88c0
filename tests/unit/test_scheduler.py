"""Scheduler and LLMEngine bookkeeping, driven by a runner whose KV cache is token ids.

Every test that generates compares against ``reference_continuation`` (no cache, no batching):
if a block were reused wrongly, overwritten while live, or lost across a preemption, the
context the runner reads back would differ and so would the tokens.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine_support import SlotMemoryRunner, assert_idle_accounting, reference_continuation, run_all
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from worker.engine.kv_cache import BlockRemoved, BlockStored
from worker.engine.sampling_params import SamplingParams


def make_engine(num_blocks=64, block_size=4, max_tokens_per_step=64, max_seqs=8, **kw):
    config = EngineConfig(model=None, num_kv_blocks=num_blocks, block_size=block_size,
                          max_num_batched_tokens=max_tokens_per_step, max_num_seqs=max_seqs, **kw)
    runner = SlotMemoryRunner(num_blocks, block_size)
    return LLMEngine(config, runner=runner), runner


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def shapes(batch):
    return [(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.is_prefill, s.samples)
            for s in batch.seqs]


def test_a_single_request_generates_the_reference_tokens():
    engine, _ = make_engine()
    prompt = list(range(1, 14))
    engine.add_request("a", prompt, greedy(6))
    tokens, finals = run_all(engine)
    assert tokens["a"] == reference_continuation(prompt, 6)
    assert finals["a"].finish_reason == "length"
    assert_idle_accounting(engine)


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    engine, runner = make_engine(max_tokens_per_step=8)
    engine.add_request("a", list(range(20)), greedy(2))
    run_all(engine)
    assert [shapes(b) for b in runner.batches] == [
        [("a", 0, 8, True, False)],
        [("a", 8, 8, True, False)],
        [("a", 16, 4, True, True)],
        [("a", 20, 1, False, True)],
    ]


def test_decodes_are_scheduled_before_a_new_prefill_which_takes_the_rest_of_the_budget():
    engine, runner = make_engine(max_tokens_per_step=8)
    engine.add_request("a", list(range(5)), greedy(3))
    engine.step()
    engine.add_request("b", list(range(100, 120)), greedy(1))
    engine.step()
    assert shapes(runner.batches[-1]) == [("a", 5, 1, False, True), ("b", 0, 7, True, False)]


def test_the_sequence_cap_keeps_extra_requests_waiting_in_arrival_order():
    engine, runner = make_engine(max_seqs=2)
    for rid in "abc":
        engine.add_request(rid, [1, 2, 3, ord(rid)], greedy(2))
    engine.step()
    assert [s.request_id for s in runner.batches[0].seqs] == ["a", "b"]
    assert engine.stats().waiting == 1
    tokens, _ = run_all(engine)
    assert tokens["c"] == reference_continuation([1, 2, 3, ord("c")], 2)


def test_a_second_request_reuses_the_cached_prefix_and_reports_cached_tokens():
    engine, runner = make_engine()
    prefix = list(range(50, 62))
    engine.add_request("a", prefix + [1, 2], greedy(1))
    run_all(engine)
    engine.add_request("b", prefix + [7, 8, 9], greedy(3))
    tokens, finals = run_all(engine)
    assert finals["b"].num_cached_tokens == 12
    assert shapes(runner.batches[-3])[0] == ("b", 12, 3, True, True)
    assert tokens["b"] == reference_continuation(prefix + [7, 8, 9], 3)
    s = engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (14 + 15, 12)


def test_preemption_recomputes_and_the_preempted_request_keeps_its_place_and_output():
    # 6 blocks of 4 tokens: a and b (8-token prompts) each grow to 16 tokens, which needs 8
    # blocks together, so the later one (b) is preempted and must resume before c.
    engine, runner = make_engine(num_blocks=6, block_size=4, max_seqs=2)
    prompts = {"a": list(range(8)), "b": list(range(10, 18)), "c": list(range(20, 28))}
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy(8))
    tokens, finals = run_all(engine)
    assert engine.stats().num_preemptions >= 1
    assert finals["b"].num_preemptions >= 1
    for rid, p in prompts.items():
        assert tokens[rid] == reference_continuation(p, 8), rid
    # Order of appearance (step, slot in the step): b's recompute comes before c's admission.
    order = [(s.request_id, s.is_prefill and s.num_output_tokens > 0)
             for batch in runner.batches for s in batch.seqs]
    assert order.index(("b", True)) < order.index(("c", False))
    assert_idle_accounting(engine)


def test_abort_frees_blocks_at_once_and_the_next_step_reports_it():
    engine, _ = make_engine(num_blocks=16)
    engine.add_request("a", list(range(30)), greedy(10))
    engine.step()
    assert engine.stats().used_blocks == 8
    assert engine.abort_request("a") is True
    assert engine.stats().used_blocks == 0
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert engine.abort_request("a") is False
    assert not engine.has_unfinished_requests()
    assert_idle_accounting(engine)


def test_kv_events_report_blocks_stored_after_their_step_and_removed_on_eviction():
    engine, _ = make_engine(num_blocks=4, block_size=4)
    engine.add_request("a", list(range(9)), greedy(1))
    assert engine.take_kv_events() == []
    run_all(engine)
    stored = engine.take_kv_events()
    hashes = engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert stored == [BlockStored(list(hashes))] and len(hashes) == 2
    old = list(hashes)
    engine.add_request("b", list(range(100, 113)), greedy(1))  # needs all 4 blocks
    run_all(engine)
    events = engine.take_kv_events()
    removed_order = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed_order == [old[1], old[0]]  # the tail block of "a" is evicted first


def test_load_stats_count_queued_prefill_and_running_tokens():
    engine, _ = make_engine(max_tokens_per_step=8, max_seqs=1)
    engine.add_request("a", list(range(20)), greedy(4))
    engine.add_request("b", list(range(30)), greedy(4))
    engine.step()  # a: 8 of 20 computed
    s = engine.stats()
    assert (s.running, s.waiting) == (1, 1)
    assert s.queued_prefill_tokens == 12 + 30
    assert s.running_tokens == 20
    assert s.used_blocks == 2 and s.kv_usage == 2 / 64  # blocks are taken chunk by chunk
    assert s.prompt_tokens_total == 50 and s.max_num_seqs == 1 and s.max_num_batched_tokens == 8


def test_requests_that_cannot_fit_are_rejected_before_queueing():
    engine, _ = make_engine(num_blocks=4, block_size=4)  # 16 tokens of KV
    with pytest.raises(PromptTooLongError):
        engine.add_request("a", list(range(16)), greedy(1))
    with pytest.raises(InvalidRequestError):
        engine.add_request("a", [], greedy(1))
    with pytest.raises(InvalidRequestError):
        engine.add_request("a", [1, 300], greedy(1))  # outside the byte vocabulary
    engine.add_request("a", list(range(15)), greedy(5))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", [1], greedy(1))
    tokens, finals = run_all(engine)
    # The context is full after one generated token: the request ends with "length".
    assert (tokens["a"], finals["a"].finish_reason) == (reference_continuation(list(range(15)), 1), "length")


def test_max_model_len_ends_generation_with_length():
    engine, _ = make_engine(max_model_len=12)
    engine.add_request("a", list(range(10)), greedy(100))
    tokens, finals = run_all(engine)
    assert len(tokens["a"]) == 2 and finals["a"].finish_reason == "length"


def test_with_prefix_caching_off_nothing_is_reused():
    engine, _ = make_engine(enable_prefix_caching=False)
    for rid in "ab":
        engine.add_request(rid, list(range(20)), greedy(2))
        _, finals = run_all(engine)
        assert finals[rid].num_cached_tokens == 0
    assert engine.take_kv_events() == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 12)),
                     min_size=1, max_size=8),
    num_blocks=st.integers(8, 24),
    budget=st.integers(4, 32),
    abort_at=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 30)), max_size=3),
)
def test_any_workload_in_a_small_pool_gives_reference_outputs_and_exact_accounting(
        prompts, num_blocks, budget, abort_at):
    # Prompts share one of 4 prefixes, so hits, eviction, preemption and aborts interleave.
    engine, _ = make_engine(num_blocks=num_blocks, block_size=4, max_tokens_per_step=budget, max_seqs=4)
    expected = {}
    for i, (prefix, length, n) in enumerate(prompts):
        prompt = ([prefix] * 9 + list(range(length)))[: min(9 + length, num_blocks * 4 - 1)]
        engine.add_request(f"r{i}", prompt, greedy(n))
        expected[f"r{i}"] = reference_continuation(prompt, n)
    aborts = {step: f"r{i}" for i, step in abort_at}
    tokens: dict[str, list[int]] = {}
    finals = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in aborts:
            engine.abort_request(aborts[step])
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.kv_cache_manager.block_pool.check_invariants()
        step += 1
    for rid, want in expected.items():
        got = tokens.get(rid, [])
        assert got == want[: len(got)], rid
        if finals[rid].finish_reason != "abort":
            # Complete, unless the request filled the whole pool (context limit).
            assert len(got) == len(want) or finals[rid].num_prompt_tokens + len(got) == num_blocks * 4
    assert_idle_accounting(engine)


def test_without_chunked_prefill_a_prompt_over_the_token_budget_is_rejected_not_queued_forever():
    # One step can never compute more than max_num_batched_tokens tokens; without chunking
    # such a prompt (or a preempted request's recompute) would wait at the head forever.
    engine, _ = make_engine(num_blocks=16, max_tokens_per_step=8, enable_chunked_prefill=False)
    with pytest.raises(PromptTooLongError):
        engine.add_request("a", list(range(20)), greedy(2))
    engine.add_request("b", list(range(5)), greedy(10))
    tokens, finals = run_all(engine)
    # Generation stops where a recompute would no longer fit one step.
    assert tokens["b"] == reference_continuation(list(range(5)), 3)
    assert finals["b"].finish_reason == "length"
    assert_idle_accounting(engine)


def test_requests_finished_before_the_engine_goes_idle_still_reach_the_runner():
    # The runner drops per-request state (sampling generators) on finished_request_ids; ids
    # finished in the last busy step must not be lost with the empty batch that follows.
    engine, runner = make_engine()
    engine.add_request("a", list(range(6)), greedy(1))
    run_all(engine)
    engine.abort_request("missing")
    engine.add_request("b", list(range(6)), greedy(1))
    engine.abort_request("b")
    run_all(engine)
    engine.add_request("c", list(range(6)), greedy(1))
    run_all(engine)
    told = [rid for b in runner.batches for rid in b.finished_request_ids]
    assert sorted(told) == ["a", "b"]
