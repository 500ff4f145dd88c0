"""The CPU KV tier as the router sees it: events with a medium, the index per medium, and a CPU
hit credited at its transfer cost (pure functions and the Balancer, no I/O)."""
from __future__ import annotations

import pytest

from protocol import KVEvent, LoadReport
from protocol.messages import MessageError
from router.routing.balancer import Balancer
from router.routing.load import LoadBoard, SpeedProfile
from router.routing.policy import PolicyConfig, prefill_seconds, tier_credit
from router.routing.prompt import PromptKey, prompt_key
from worker.engine.kv_cache import BlockRemoved, BlockStored
from worker.server.kv_events import KVEventMapper, RequestChunks

KNEE = 32768.0
DOC = "".join(f"Clause {i}: the tenant shall keep the premises in good repair. " for i in range(40))


# ---- the credit -----------------------------------------------------------------------------

def test_a_cpu_hit_is_credited_at_its_transfer_time_when_that_beats_recomputing():
    tokens, seconds = tier_credit(gpu_tokens=0, cpu_tokens=1000, tokens_per_s=1000.0,
                                  transfer_tokens_per_s=100_000.0, knee=KNEE)
    assert (tokens, seconds) == (1000, pytest.approx(0.01))


def test_a_cpu_hit_slower_to_load_than_to_recompute_credits_nothing():
    # 1,000 tokens: 0.1 s to load, 1000 * (1 + 500/32768) / 20000 = 0.0508 s to recompute
    assert tier_credit(0, 1000, 20_000.0, 10_000.0, KNEE) == (0, 0.0)


def test_nothing_in_the_tier_or_no_rate_credits_nothing():
    assert tier_credit(512, 0, 1000.0, 1e6, KNEE) == (0, 0.0)
    assert tier_credit(512, 512, 1000.0, 0.0, KNEE) == (0, 0.0)


def test_the_recompute_side_is_priced_after_the_gpu_hit():
    # 64 tokens after a 32,768-token GPU hit cost twice their cold prefill: a rate that loses
    # against a cold prefill wins after a long GPU hit.
    rate, transfer = 1000.0, 1000.0 / 1.5  # 0.096 s to load 64 tokens
    assert prefill_seconds(64, 0, rate, KNEE) < 64 / transfer
    assert tier_credit(0, 64, rate, transfer, KNEE) == (0, 0.0)
    assert tier_credit(32768, 64, rate, transfer, KNEE) == (64, pytest.approx(0.096))


# ---- events and the index -------------------------------------------------------------------

def test_kv_events_carry_a_medium_and_refuse_an_unknown_one():
    event = KVEvent.from_dict({"worker_id": "w1", "kind": "stored", "hashes": [1], "medium": "cpu"})
    assert event.medium == "cpu"
    assert KVEvent.from_dict({"worker_id": "w1", "kind": "stored", "hashes": [1]}).medium == "gpu"
    with pytest.raises(MessageError):
        KVEvent.from_dict({"worker_id": "w1", "kind": "stored", "hashes": [1], "medium": "nvme"})


def test_the_worker_translates_each_tier_s_events_with_its_medium():
    mapper = KVEventMapper()
    mapper.register(RequestChunks(chunk_hashes=[101, 102], chunk_block_ids=[0, 1], block_hashes=[7, 8]))
    out = mapper.translate([BlockStored([7, 8]), BlockRemoved([8]), BlockStored([8], medium="cpu")])
    assert [(e.kind, e.hashes, e.medium) for e in out] == [
        ("stored", [101, 102], "gpu"), ("removed", [102], "gpu"), ("stored", [102], "cpu")]
    # a later request's chunk on block 8 is announced for the tier that holds it
    late = mapper.register(RequestChunks(chunk_hashes=[202], chunk_block_ids=[1], block_hashes=[7, 8]))
    assert [(e.kind, e.hashes, e.medium) for e in late] == [("stored", [202], "cpu")]


def make(**kwargs) -> Balancer:
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, block_size=16))
    b = Balancer(PolicyConfig(affinity=0.8), chunk_size=128, board=board, tokens_per_byte=1.0, **kwargs)
    for w in ("w1", "w2", "w3"):
        b.add_worker(w, block_size=16)
        b.apply_report(LoadReport(worker_id=w, kv_tier_load_tokens_per_s=500_000.0, prefill_tokens_per_s=1000.0,
                                  block_size=16, ts=0.0), now=0.0)
    return b


def key(text: str) -> PromptKey:
    return prompt_key({"model": "tiny", "prompt": text}, chat=False, chunk_size=128, ring_key_chunks=8)


def test_cpu_events_fill_the_cpu_index_and_not_the_gpu_one():
    b = make()
    p = key(DOC[:2000])
    b.apply_kv_event(KVEvent("w2", "stored", p.hashes, chunk_size=128, seq=1, medium="cpu"), now=0.0)
    assert b.index.match(p.hashes, now=0.0) == {}
    assert b.cpu_index.match(p.hashes, now=0.0) == {"w2": 15}
    b.apply_kv_event(KVEvent("w2", "cleared", [], chunk_size=128, seq=2), now=0.0)
    assert b.cpu_index.match(p.hashes, now=0.0) == {}


def test_a_cpu_holder_wins_over_a_cold_worker_at_its_transfer_cost():
    b = make()
    p = key(DOC[:2000] + " what is clause 3?")
    b.apply_kv_event(KVEvent("w2", "stored", p.hashes[:15], chunk_size=128, seq=1, medium="cpu"), now=0.0)
    d = b.decide(p, now=0.0)
    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == ("w2", "prefix", 1920)
    costs = dict(d.costs)
    # a cold worker prefills all 2,018 tokens; w2 prefills 98 after loading 1,920 at 500K tokens/s
    assert costs["w2"] < min(costs["w1"], costs["w3"])


def test_a_gpu_holder_wins_over_a_cpu_holder_of_the_same_prefix():
    b = make()
    p = key(DOC[:2000] + " what is clause 3?")
    b.apply_kv_event(KVEvent("w2", "stored", p.hashes[:15], chunk_size=128, seq=1, medium="cpu"), now=0.0)
    b.apply_kv_event(KVEvent("w3", "stored", p.hashes[:15], chunk_size=128, seq=1), now=0.0)
    d = b.decide(p, now=0.0)
    assert d.worker_id == "w3"
    cpu = next(c for c in b.candidate_set(p, b.index.match(p.hashes, 0.0), 2018, 0.0, set(), b.config)
               if c.worker_id == "w2")
    assert cpu.cached_tokens == 1920 and cpu.transfer_s == pytest.approx(1920 / 500_000.0)


def test_the_cpu_run_after_a_gpu_hit_extends_the_match():
    b = make()
    p = key(DOC[:2000] + " what is clause 3?")
    b.apply_kv_event(KVEvent("w1", "stored", p.hashes[:5], chunk_size=128, seq=1), now=0.0)
    b.apply_kv_event(KVEvent("w1", "stored", p.hashes[5:15], chunk_size=128, seq=2, medium="cpu"), now=0.0)
    d = b.decide(p, now=0.0)
    assert (d.worker_id, d.predicted_cached_tokens, d.matched_chunks) == ("w1", 1920, 5)


def test_a_tier_too_slow_to_beat_recompute_is_not_credited():
    b = make()
    # 1,920 tokens load in 1.92 s and recompute in 1920 * (1 + 960/32768) / 2000 = 0.99 s
    b.apply_report(LoadReport(worker_id="w2", kv_tier_load_tokens_per_s=1000.0, prefill_tokens_per_s=2000.0,
                              block_size=16, ts=1.0), now=1.0)
    p = key(DOC[:2000] + " what is clause 3?")
    b.apply_kv_event(KVEvent("w2", "stored", p.hashes[:15], chunk_size=128, seq=1, medium="cpu"), now=1.0)
    cands = {c.worker_id: c for c in b.candidate_set(p, {}, 2018, 1.0, set(), b.config)}
    assert cands["w2"].cached_tokens == 0 and cands["w2"].transfer_s == 0.0
