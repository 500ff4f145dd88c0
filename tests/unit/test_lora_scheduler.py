"""The scheduler with LoRA slots: at most --max-loras adapters per step, nobody starves, loads
between steps, and a prefix cache keyed by adapter identity.

The runner (tests/engine_support.py) mixes the identity of the adapter it finds in a sequence's
slot into every token, so a request computed with the wrong adapter -- a slot reassigned while
it ran, a load applied too late -- generates other tokens than its reference.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine_support import SlotMemoryRunner, assert_idle_accounting, reference_continuation, run_all
from tests.lora_support import write_adapter
from worker.engine.config import EngineConfig
from worker.engine.errors import LoRADisabledError
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams


def make_engine(max_loras=2, num_blocks=128, block_size=4, max_tokens_per_step=64, max_seqs=16, **kw):
    config = EngineConfig(model=None, num_kv_blocks=num_blocks, block_size=block_size,
                          max_num_batched_tokens=max_tokens_per_step, max_num_seqs=max_seqs,
                          enable_lora=True, max_loras=max_loras, **kw)
    runner = SlotMemoryRunner(num_blocks, block_size)
    return LLMEngine(config, runner=runner), runner


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def adapters(tmp_path):
    def make(engine, *names):
        return [engine.add_lora(n, str(write_adapter(tmp_path / n, seed=i))) for i, n in enumerate(names)]
    return make


def assert_idle(engine):
    assert_idle_accounting(engine)
    assert engine.scheduler.lora_slots.pins == [0] * (engine.config.max_loras + 1)
    assert all(a.refcount == 0 for a in engine.list_loras())


def prompt(i, n=10):
    return [(7 * i + j) % 200 + 1 for j in range(n)]


def test_three_adapters_queued_with_two_slots_all_finish_and_no_step_holds_more_than_two(adapters):
    engine, runner = make_engine(max_loras=2)
    a, b, c = adapters(engine, "a", "b", "c")
    expected = {}
    for i in range(9):
        lora = (a, b, c)[i % 3]
        engine.add_request(f"r{i}", prompt(i), greedy(6), lora=lora)
        expected[f"r{i}"] = reference_continuation(prompt(i), 6, lora.identity)

    tokens, finals = run_all(engine)

    assert tokens == expected
    assert all(out.finish_reason == "length" for out in finals.values())
    assert max(len(step) for step in runner.step_adapters) == 2
    assert {name for step in runner.step_adapters for name in step} == {a.identity, b.identity, c.identity}
    assert all(len({s.lora_slot for s in batch.seqs if s.lora_slot}) <= 2 for batch in runner.batches)
    assert_idle(engine)


def test_a_waiting_adapter_is_not_starved_by_a_stream_for_the_adapters_in_slots(adapters):
    # Requests for a and b arrive every step, so a and b always have running requests; c, queued
    # behind the first of them, must still get a slot: one of a/b's slots stops admitting (drains).
    engine, runner = make_engine(max_loras=2, max_seqs=32)
    a, b, c = adapters(engine, "a", "b", "c")
    engine.add_request("a0", prompt(0), greedy(8), lora=a)
    engine.add_request("b0", prompt(1), greedy(8), lora=b)
    engine.step()
    engine.add_request("c0", prompt(2), greedy(4), lora=c)
    finished_at = None
    for step in range(60):
        engine.add_request(f"a{step + 1}", prompt(10 + step), greedy(8), lora=a)
        engine.add_request(f"b{step + 1}", prompt(100 + step), greedy(8), lora=b)
        for out in engine.step():
            if out.request_id == "c0" and out.finished:
                finished_at = step
        if finished_at is not None:
            break

    assert finished_at is not None and finished_at < 20, finished_at
    assert max(len(s) for s in runner.step_adapters) <= 2
    assert c.counters.slot_wait_s > 0
    run_all(engine)
    assert_idle(engine)


def test_base_model_requests_pass_a_request_waiting_for_a_slot(adapters):
    engine, runner = make_engine(max_loras=1)
    a, b = adapters(engine, "a", "b")
    engine.add_request("a0", prompt(0), greedy(5), lora=a)
    engine.step()
    engine.add_request("b0", prompt(1), greedy(5), lora=b)  # blocked: the only slot is a's
    engine.add_request("base", prompt(2), greedy(5))

    engine.step()

    scheduled = [s.request_id for s in runner.batches[-1].seqs]
    assert scheduled == ["a0", "base"]
    tokens, _ = run_all(engine)
    assert tokens["b0"] == reference_continuation(prompt(1), 5, b.identity)
    assert_idle(engine)


def test_an_adapter_is_loaded_into_its_slot_by_the_batch_that_first_uses_it_and_only_then(adapters):
    engine, runner = make_engine(max_loras=2)
    a, b, c = adapters(engine, "a", "b", "c")
    engine.add_request("a0", prompt(0), greedy(2), lora=a)
    engine.add_request("b0", prompt(1), greedy(2), lora=b)
    run_all(engine)
    engine.add_request("a1", prompt(2), greedy(2), lora=a)  # a is still in its slot: no load
    run_all(engine)
    engine.add_request("c0", prompt(3), greedy(2), lora=c)  # evicts b, the least recently used
    run_all(engine)

    loads = [[(slot, adapter.name) for slot, adapter in batch.lora_loads] for batch in runner.batches]
    assert [step for step in loads if step] == [[(1, "a"), (2, "b")], [(2, "c")]]
    first_c = next(batch for batch in runner.batches if any(s.request_id == "c0" for s in batch.seqs))
    assert first_c.lora_loads and first_c.lora_loads[0][1] is c
    assert (a.counters.slot_loads, b.counters.slot_loads, c.counters.slot_loads) == (1, 1, 1)
    assert (a.counters.slot_evictions, b.counters.slot_evictions) == (0, 1)
    lora = engine.stats().lora
    assert (lora.gpu, lora.cpu) == (["a", "c"], ["b"])
    assert_idle(engine)


def test_preemption_under_kv_pressure_releases_slots_and_every_adapter_request_finishes_right(adapters):
    engine, runner = make_engine(max_loras=2, num_blocks=24, max_tokens_per_step=32)
    loras = adapters(engine, "a", "b", "c")
    expected = {}
    for i in range(8):
        lora = loras[i % 3] if i % 4 else None
        engine.add_request(f"r{i}", prompt(i, 20), greedy(16), lora=lora)
        expected[f"r{i}"] = reference_continuation(prompt(i, 20), 16, lora.identity if lora else None)

    tokens, _ = run_all(engine)

    assert engine.stats().num_preemptions > 0
    assert tokens == expected
    assert max(len(s) for s in runner.step_adapters) <= 2
    assert_idle(engine)


def test_two_adapters_never_share_kv_and_the_base_model_shares_none_with_them(adapters):
    engine, _ = make_engine()
    a, b = adapters(engine, "a", "b")
    p = prompt(0, 21)
    first = engine.generate([p], greedy(2))[0]
    with_a = run_one(engine, "a0", p, a)
    with_b = run_one(engine, "b0", p, b)
    again_a = run_one(engine, "a1", p, a)

    assert (first.num_cached_tokens, with_a.num_cached_tokens, with_b.num_cached_tokens) == (0, 0, 0)
    assert again_a.num_cached_tokens == 20  # five full blocks of 4; the last token is recomputed
    assert with_a.token_ids != with_b.token_ids


def run_one(engine, rid, p, lora):
    engine.add_request(rid, p, greedy(2), lora=lora)
    _, finals = run_all(engine)
    return finals[rid]


def test_reloading_a_name_with_new_weights_never_reuses_its_blocks_and_old_weights_hit_again(tmp_path):
    engine, _ = make_engine()
    v1, v2 = write_adapter(tmp_path / "v1", seed=1), write_adapter(tmp_path / "v2", seed=2)
    p = prompt(3, 21)
    old = engine.add_lora("sql", str(v1))
    run_one(engine, "r1", p, old)

    new = engine.add_lora("sql", str(v2), replace=True)
    reloaded = run_one(engine, "r2", p, new)
    back = engine.add_lora("sql", str(v1), replace=True)  # the first weights again: same identity
    hit = run_one(engine, "r3", p, back)

    assert new.digest != old.digest and back.digest == old.digest
    assert reloaded.num_cached_tokens == 0
    assert reloaded.token_ids[-2:] == reference_continuation(p, 2, new.identity)
    assert hit.num_cached_tokens == 20


def test_an_unloaded_adapter_finishes_its_running_requests_and_then_frees_its_weights(adapters):
    engine, _ = make_engine()
    (a,) = adapters(engine, "a")
    engine.add_request("a0", prompt(0), greedy(6), lora=a)
    first = engine.step()
    engine.remove_lora("a")

    tokens, _ = run_all(engine)

    assert first[0].new_token_ids + tokens["a0"] == reference_continuation(prompt(0), 6, a.identity)
    assert a.weights is None and a.refcount == 0
    assert engine.list_loras() == [] and engine.stats().lora.gpu == []


def test_stats_count_running_and_waiting_requests_per_adapter(adapters):
    engine, _ = make_engine(max_loras=1)
    a, b = adapters(engine, "a", "b")
    engine.add_request("a0", prompt(0), greedy(4), lora=a)
    engine.add_request("a1", prompt(1), greedy(4), lora=a)
    engine.add_request("b0", prompt(2), greedy(4), lora=b)
    engine.step()

    lora = engine.stats().lora
    assert (lora.running, lora.waiting) == ({"a": 2}, {"b": 1})
    assert (lora.max_loras, lora.gpu, lora.adapters) == (1, ["a"], {"a": a.short_digest, "b": b.short_digest})
    assert engine.stats().load_report_fields()["lora_waiting"] == {"b": 1}


def test_an_engine_without_lora_refuses_an_adapter(tmp_path):
    config = EngineConfig(model=None, num_kv_blocks=16, block_size=4)
    engine = LLMEngine(config, runner=SlotMemoryRunner(16, 4))
    with pytest.raises(LoRADisabledError):
        engine.add_lora("a", str(write_adapter(tmp_path / "a")))
    assert engine.stats().lora is None


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [str(write_adapter(root / f"ad{i}", seed=i)) for i in range(3)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 10), st.integers(0, 4)),
                         min_size=1, max_size=12),
       max_loras=st.integers(1, 3), num_blocks=st.integers(14, 48), budget=st.integers(8, 40))
def test_any_mix_of_adapters_arrivals_and_pool_sizes_serves_every_request_right(
        adapter_dirs, requests, max_loras, num_blocks, budget):
    # (adapter or 3 = base, prompt length, output length, step it arrives at)
    engine, runner = make_engine(max_loras=max_loras, num_blocks=num_blocks, max_tokens_per_step=budget)
    loras = [engine.add_lora(f"ad{i}", d) for i, d in enumerate(adapter_dirs)]
    expected, tokens = {}, {}
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][3] <= step:
            i, (which, n_prompt, n_out, _) = pending.pop(0)
            lora = loras[which] if which < 3 else None
            engine.add_request(f"r{i}", prompt(i, n_prompt), greedy(n_out), lora=lora)
            expected[f"r{i}"] = reference_continuation(prompt(i, n_prompt), n_out, lora.identity if lora else None)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
        assert step < 2000, "no progress"

    assert tokens == expected
    assert max((len(s) for s in runner.step_adapters), default=0) <= max_loras
    assert_idle(engine)
