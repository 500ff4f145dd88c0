"""The CPU KV tier: host pool bookkeeping, store policies, the transfer-vs-recompute decision, and
the engine with a tier, driven by a runner whose KV cache is token ids (tests/engine_support.py).

The runner here also keeps a host copy per slot and runs each step's tier copies, so a block
loaded from the wrong slot, or a slot overwritten while a load reads it, changes the context the
runner reads back -- and the generated tokens, which every engine test compares against
``reference_continuation`` (no cache at all).
"""
from __future__ import annotations

import pytest

from tests.engine_support import SlotMemoryRunner, assert_idle_accounting, reference_continuation, run_all
from worker.engine.config import EngineConfig
from worker.engine.kv_cache import BlockRemoved, BlockStored, KVCacheBlock
from worker.engine.kv_cache.host_pool import HostBlockPool
from worker.engine.kv_cache.kv_tier import KVTier
from worker.engine.llm_engine import LLMEngine
from worker.engine.runner import RunnerOutput, ScheduledBatch
from worker.engine.sampling_params import SamplingParams
from worker.engine.stats import SpeedMeter
from worker.simulator.runner import build_simulated_engine

BS = 4


class TieredSlotMemoryRunner(SlotMemoryRunner):
    """:class:`SlotMemoryRunner` plus a host copy of blocks: stores then loads, before the step.

    ``fail_stores``: every store fails (nothing copied, ``kv_stores_ok`` False).
    """

    kv_block_bytes = 1024

    def __init__(self, num_blocks: int, block_size: int, fail_stores: bool = False) -> None:
        super().__init__(num_blocks, block_size)
        self.host: dict[int, list[int | None]] = {}
        self.fail_stores = fail_stores

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        bs = self.block_size
        if not self.fail_stores:
            for gpu, slot in batch.kv_stores:
                self.host[slot] = self.slots[gpu * bs:(gpu + 1) * bs]
        for slot, gpu in batch.kv_loads:
            data = self.host[slot]
            assert None not in data, f"loaded host slot {slot} holds an unwritten token"
            self.slots[gpu * bs:(gpu + 1) * bs] = data
        out = super().execute(batch)
        out.kv_stores_ok = not (self.fail_stores and batch.kv_stores)
        return out


def make_engine(num_blocks=8, cpu_blocks=8, bandwidth=1e12, fail_stores=False, max_tokens_per_step=64, **kw):
    config = EngineConfig(model=None, num_kv_blocks=num_blocks, block_size=BS,
                          max_num_batched_tokens=max_tokens_per_step, max_num_seqs=8,
                          cpu_kv_blocks=cpu_blocks, cpu_kv_load_bytes_per_s=bandwidth, **kw)
    runner = TieredSlotMemoryRunner(num_blocks, BS, fail_stores)
    return LLMEngine(config, runner=runner), runner


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def serve(engine, rid, prompt, n=1):
    engine.add_request(rid, prompt, greedy(n))
    tokens, finals = run_all(engine)
    assert tokens[rid] == reference_continuation(prompt, n)
    return finals[rid]


def computed_tokens(runner, rid):
    """Tokens the runner computed for ``rid`` (prefill and decode)."""
    return sum(s.num_scheduled_tokens for b in runner.batches for s in b.seqs if s.request_id == rid)


A = list(range(100, 124))  # 6 blocks of 4
B = list(range(200, 224))  # 6 other blocks


# ---- host pool ----------------------------------------------------------------------------------

def test_a_reserved_block_is_loadable_only_after_its_copy_is_committed():
    pool = HostBlockPool(4)
    entry = pool.reserve(11)
    assert pool.lookup_run([11]) == []  # pending: the copy has not run
    pool.commit([entry])
    assert pool.lookup_run([11, 12]) == [entry]
    assert entry.pins == 0 and pool.num_stored == 1
    assert pool.take_events() == [BlockStored([11], None, medium="cpu")]


def test_a_failed_store_leaves_nothing_loadable_and_frees_its_slot():
    pool = HostBlockPool(1)
    entry = pool.reserve(11)
    pool.discard([entry])
    assert pool.lookup_run([11]) == [] and 11 not in pool and pool.num_stored == 0
    assert pool.take_events() == []  # nothing was ever announced
    assert pool.reserve(12) is not None  # the slot is free again


def test_the_least_recently_used_unpinned_block_is_evicted_first():
    pool = HostBlockPool(3)
    entries = {h: pool.reserve(h) for h in (1, 2, 3)}
    pool.commit(entries.values())
    pool.take_events()
    pool.pin([entries[1]])  # a load reads block 1: it may not go
    pool.touch(2)  # 2 is now more recently used than 3
    new = pool.reserve(4)
    assert new is not None and new.slot == entries[3].slot
    assert pool.slot_hashes() == [1, 2, 4]
    assert pool.take_events() == [BlockRemoved([3], medium="cpu")]


def test_a_pool_whose_every_slot_is_pinned_refuses_a_store():
    pool = HostBlockPool(2)
    pool.reserve(1)
    pool.reserve(2)  # both pending, hence pinned
    assert pool.reserve(3) is None


def test_the_lookup_is_the_longest_contiguous_stored_run():
    pool = HostBlockPool(4)
    pool.commit([pool.reserve(1), pool.reserve(2), pool.reserve(4)])
    assert [e.block_hash for e in pool.lookup_run([1, 2, 3, 4])] == [1, 2]
    assert pool.lookup_run([3, 4]) == []


# ---- the decision -------------------------------------------------------------------------------

def test_loading_wins_when_the_transfer_is_faster_than_the_measured_prefill():
    speed = SpeedMeter(prefill_tokens_per_s=1000.0, decode_step_s=0.01)
    tier = KVTier(8, block_size=16, block_bytes=1_000_000, load_bytes_per_s=1e9)
    # 4 blocks = 64 tokens: 4 MB at 1 GB/s = 4 ms; 64 tokens at 1000/s = 64 ms
    assert tier.transfer_seconds(4) == pytest.approx(0.004)
    assert tier.should_load(4, 0, speed)
    tier.load_bytes_per_s = 1e7  # 0.4 s > 64 ms (and the ~64.1 ms at 16 cached tokens)
    assert not tier.should_load(4, 16, speed)


def test_the_recompute_side_uses_the_engine_speed_at_that_context():
    speed = SpeedMeter(prefill_tokens_per_s=1000.0, decode_step_s=0.01)
    short = KVTier.recompute_seconds(64, 0, speed)
    deep = KVTier.recompute_seconds(64, 32768, speed)  # attention over a long context costs double
    assert short == pytest.approx(64 * (1 + 32 / 32768) / 1000)
    assert deep == pytest.approx(64 * (1 + (32768 + 32) / 32768) / 1000)


def test_measured_load_bandwidth_replaces_the_configured_one():
    tier = KVTier(4, block_size=4, block_bytes=1000, load_bytes_per_s=1.0)
    tier.take_copies()
    tier.finish_copies(stores_ok=True, load_s=1.0)
    assert not tier.load_measured  # nothing was loaded: nothing measured
    entry = tier.host.reserve(5)
    tier.host.commit([entry])
    tier.pin([entry])
    tier.plan_load([entry], [KVCacheBlock(3)])
    assert tier.take_copies().loads == [(entry.slot, 3)]
    tier.finish_copies(stores_ok=True, load_s=0.5)
    assert tier.load_measured and tier.load_bytes_per_s == pytest.approx(2000.0)
    assert entry.pins == 0  # the load's source is released with the step


# ---- the engine with a tier ---------------------------------------------------------------------

def test_revisit_loads_the_evicted_prefix_and_computes_at_most_one_block():
    engine, runner = make_engine()
    first = serve(engine, "a1", A)
    assert first.num_cached_tokens == 0
    serve(engine, "b", B)  # 6 blocks in a pool of 8: evicts A's last four blocks (to the tier)
    again = serve(engine, "a2", A)
    # A's first 2 blocks are still on the GPU, the next 3 come back from the tier, the last
    # block (holding the last prompt token) is computed: 4 tokens of 24.
    assert computed_tokens(runner, "a2") == BS
    assert again.num_cached_tokens == 20 and again.num_loaded_tokens == 12
    tier = engine.stats().kv_tier
    assert tier.counters.loaded_tokens == 12 and tier.counters.loaded_blocks == 3
    assert tier.counters.recomputed_tokens == 0
    assert tier.counters.bytes_loaded == 3 * 1024
    assert_idle_accounting(engine)


def test_without_a_tier_the_revisit_recomputes_what_was_evicted():
    engine, runner = make_engine(cpu_blocks=0)
    serve(engine, "a1", A)
    serve(engine, "b", B)
    again = serve(engine, "a2", A)
    assert engine.kv_tier is None
    assert again.num_cached_tokens == 8 and computed_tokens(runner, "a2") == 16


def test_near_zero_bandwidth_forces_recompute():
    engine, runner = make_engine(bandwidth=1e-3)
    serve(engine, "a1", A)
    serve(engine, "b", B)
    again = serve(engine, "a2", A)
    assert again.num_cached_tokens == 8 and again.num_loaded_tokens == 0
    assert computed_tokens(runner, "a2") == 16
    counters = engine.stats().kv_tier.counters
    assert counters.recomputed_tokens == 12 and counters.loaded_tokens == 0
    assert all(not b.kv_loads for b in runner.batches)


def test_a_failed_store_leaves_nothing_loadable():
    engine, runner = make_engine(fail_stores=True)
    serve(engine, "a1", A)
    serve(engine, "b", B)  # the stores of A's four evicted blocks fail
    stats = engine.stats().kv_tier
    assert stats.stored_blocks == 0 and stats.counters.failed_stores == 4
    events = engine.take_kv_events()
    again = serve(engine, "a2", A)  # and so A is recomputed, correctly
    assert again.num_loaded_tokens == 0 and computed_tokens(runner, "a2") == 16
    events += engine.take_kv_events()
    assert not any(getattr(e, "medium", "gpu") == "cpu" for e in events)


def test_write_back_announces_cpu_stores_after_the_copy_and_gpu_removals_at_eviction():
    engine, _ = make_engine()
    serve(engine, "a1", A)
    engine.take_kv_events()
    serve(engine, "b", B)
    events = engine.take_kv_events()
    removed_gpu = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "gpu" for h in e.block_hashes]
    stored_cpu = [h for e in events if isinstance(e, BlockStored) and e.medium == "cpu" for h in e.block_hashes]
    assert len(removed_gpu) == 4 and sorted(stored_cpu) == sorted(removed_gpu)
    first_cpu = next(i for i, e in enumerate(events) if isinstance(e, BlockStored) and e.medium == "cpu")
    first_removed = next(i for i, e in enumerate(events) if isinstance(e, BlockRemoved))
    assert first_removed < first_cpu


def test_write_through_copies_blocks_when_they_are_cached():
    engine, runner = make_engine(cpu_blocks=16, cpu_kv_store_policy="write_through")
    serve(engine, "a1", A)
    serve(engine, "x", [7, 7, 7, 7, 7])  # its step carries the copies of A's 6 blocks
    # (x's own block was cached after its last step: its copy waits for the next step)
    assert engine.stats().kv_tier.stored_blocks == 6
    assert sum(len(b.kv_stores) for b in runner.batches) == 6
    serve(engine, "b", B)  # evicting A's blocks copies nothing more: the tier has them
    assert sum(len(b.kv_stores) for b in runner.batches) == 7  # x's block only
    again = serve(engine, "a2", A)  # A0 is still on the GPU (x took one block), A1..A4 load
    assert again.num_cached_tokens == 20 and again.num_loaded_tokens == 16


def test_selective_stores_only_blocks_reused_min_hits_times():
    engine, _ = make_engine(cpu_kv_store_policy="selective", cpu_kv_min_hits=1)
    serve(engine, "a1", A[:12] + [1, 2, 3, 4, 5])  # blocks A0..A2 computed
    serve(engine, "a2", A[:12] + [9, 9, 9, 9, 9])  # A0..A2 hit once
    serve(engine, "b", list(range(200, 231)))  # 8 blocks: evicts everything cached
    stored = engine.stats().kv_tier.stored_blocks
    assert stored == 3  # only the reused A0..A2 went down


def test_a_preempted_request_resumes_by_loading_its_own_blocks():
    engine, runner = make_engine(num_blocks=10, cpu_blocks=16, max_tokens_per_step=64)
    pa, pb = list(range(10, 26)), list(range(40, 56))
    engine.add_request("a", pa, greedy(12))
    engine.add_request("b", pb, greedy(12))
    tokens, finals = run_all(engine)
    assert tokens["a"] == reference_continuation(pa, 12)
    assert tokens["b"] == reference_continuation(pb, 12)
    assert finals["b"].num_preemptions >= 1
    loads = [(b, s) for b in runner.batches if b.kv_loads for s in b.seqs if s.request_id == "b"]
    assert loads, "b was readmitted without loading anything"
    batch, seq = loads[0]
    # its readmission starts past the loaded blocks: they were b's own (else the tokens differ)
    assert seq.num_computed_tokens >= len(batch.kv_loads) * BS
    assert engine.stats().kv_tier.counters.loaded_tokens >= len(batch.kv_loads) * BS
    assert_idle_accounting(engine)


def test_reset_clears_both_tiers():
    engine, _ = make_engine()
    serve(engine, "a1", A)
    serve(engine, "b", B)
    assert engine.reset_prefix_cache()
    assert engine.stats().kv_tier.stored_blocks == 0
    again = serve(engine, "a2", A)
    assert again.num_cached_tokens == 0


def test_a_written_back_lora_block_is_announced_with_its_adapter():
    tier = KVTier(4, block_size=4, block_bytes=16)
    block = KVCacheBlock(0)
    block.block_hash = 77
    tier.on_gpu_cached([block], "sql")
    tier.on_gpu_evict(block)
    assert tier.take_copies().stores == [(0, 0)]
    tier.finish_copies(stores_ok=True)
    assert tier.take_events() == [BlockStored([77], "sql", medium="cpu")]


def test_blocks_chosen_for_a_load_are_pinned_against_the_stores_its_allocation_causes():
    # The tier (4 slots) is full of A's evicted blocks. Readmitting A allocates GPU blocks, which
    # evicts B's blocks, whose write-back stores want host slots: they may take A5 (not loaded)
    # but never A2..A4, which this very step loads (stores run first: a reused slot would hand
    # A a block of B, and the runner would generate other tokens).
    engine, runner = make_engine(cpu_blocks=4)
    serve(engine, "a1", A)
    serve(engine, "b", B)
    again = serve(engine, "a2", A)  # serve() checks the tokens against the reference
    assert again.num_loaded_tokens == 12
    counters = engine.stats().kv_tier.counters
    assert counters.skipped_stores >= 1  # a store found every slot pinned and gave up
    loads = next(b for b in runner.batches if b.kv_loads)
    assert {slot for _, slot in loads.kv_stores}.isdisjoint(slot for slot, _ in loads.kv_loads)


def test_an_idle_write_through_engine_can_reset_with_stores_still_queued():
    engine, _ = make_engine(cpu_kv_store_policy="write_through")
    serve(engine, "a1", A)  # A's blocks are cached after its last step: their copies are queued
    assert engine.kv_tier.has_queued_copies
    assert engine.reset_prefix_cache()
    assert not engine.kv_tier.has_queued_copies and engine.stats().kv_tier.stored_blocks == 0
    assert serve(engine, "a2", A).num_cached_tokens == 0


def test_the_simulated_worker_charges_tier_copies_at_the_profile_bandwidth():
    engine, runner = build_simulated_engine("H100-80G", "llama-3-8b", time_scale=1000.0, num_kv_blocks=8,
                                            block_size=16, cpu_kv_blocks=64)
    a, b = list(range(1, 97)), list(range(101, 197))
    for prompt in (a, b):
        engine.generate([prompt], greedy(1))
    again = engine.generate([a], greedy(1))[0]
    tier = engine.stats().kv_tier
    assert tier.block_bytes == 16 * 128 * 1024  # Llama-3-8B: 128 KiB of KV per token
    assert again.num_loaded_tokens == 48 and tier.counters.bytes_loaded == 3 * tier.block_bytes
    # measured from the modelled copy time (over the time scale, as the engine sees it)
    assert tier.load_measured and tier.load_bytes_per_s == pytest.approx(50e9 * 1000.0)
