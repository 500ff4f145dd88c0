"""Balancer: index + ring + loads + policy together, driven in virtual time (no I/O)."""
from __future__ import annotations

import pytest

from protocol import KVEvent, LoadReport
from router.routing.balancer import Balancer
from router.routing.load import LoadBoard, SpeedProfile
from router.routing.policy import NOT_ON_RING, NoCapacity, PolicyConfig, prefill_seconds
from router.routing.prompt import PromptKey, prompt_key

WORKERS = ["w1", "w2", "w3", "w4"]
DOC = "".join(f"Clause {i}: the tenant shall keep the premises in good repair. " for i in range(40))


def make(policy: str = "cache_aware", affinity: float = 0.8, **kwargs) -> Balancer:
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, block_size=16))
    b = Balancer(PolicyConfig(policy=policy, affinity=affinity), chunk_size=128, board=board,
                 tokens_per_byte=1.0, **kwargs)
    for w in WORKERS:
        b.add_worker(w, block_size=16)
    return b


def key(text: str, session: str | None = None) -> PromptKey:
    return prompt_key({"model": "tiny", "prompt": text}, chat=False, chunk_size=128, ring_key_chunks=8,
                      session_key=session)


def test_a_new_prefix_goes_to_its_ring_owner_and_two_routers_agree():
    r1, r2 = make(), make()
    for i in range(40):
        p = key(f"request {i}: " + DOC)
        d1, d2 = r1.decide(p, now=0.0), r2.decide(p, now=0.0)
        assert (d1.worker_id, d1.reason) == (r1.ring.owner(p.ring_key), "ring")
        assert d2.worker_id == d1.worker_id


def test_a_session_without_a_match_goes_to_the_sessions_ring_position():
    b = make()
    p1, p2 = key("hello", session="user-42"), key("something else entirely", session="user-42")
    d1, d2 = b.decide(p1, now=0.0), b.decide(p2, now=0.0)
    assert d1.reason == d2.reason == "session"
    assert d1.worker_id == d2.worker_id == b.ring.owner(p1.ring_key)


def test_a_request_sharing_a_dispatched_prefix_follows_it_with_an_exact_prediction():
    b = make()
    first = key(DOC[:2000])                      # 15 full chunks
    d1 = b.decide(first, now=0.0)
    b.dispatch(d1, first, now=0.0)
    second = key(DOC[:1500] + " and a different question")  # shares 11 chunks = 1,408 bytes
    d2 = b.decide(second, now=0.1)
    assert (d2.worker_id, d2.reason, d2.predicted_cached_tokens) == (d1.worker_id, "prefix", 1408)


def test_a_hot_prefix_spills_to_the_next_workers_on_its_ring_as_its_owner_queues_up():
    # Affinity 0.5 (cost = predicted TTFT). A 2,000-byte document is cached on its owner (its
    # prefill done); each question adds ~1.1 s of uncached prefill there (1,093 tokens over the
    # cached 1,920), against a 3.15 s cold prefill anywhere else.
    b = make(affinity=0.5)
    doc = key(DOC[:2000])
    ring = b.ring.successors(doc.ring_key, 4)
    b.first_byte(b.dispatch(b.decide(doc, now=0.0), doc, now=0.0), now=0.0)
    placed = []
    for i in range(6):
        p = key(DOC[:2000] + f" question {i}: " + "why? " * 200)
        d = b.decide(p, now=0.0)
        b.dispatch(d, p, now=0.0)  # nothing finishes: queues only grow
        placed.append((d.worker_id, d.reason))
    assert placed == [(ring[0], "prefix"), (ring[0], "prefix"),   # 1.18 s, then 2.27 s < 3.15 s
                      (ring[1], "spill"), (ring[2], "spill"), (ring[3], "spill"),  # in ring order
                      (ring[0], "prefix")]
    assert b.index.match(doc.hashes, now=0.0)[ring[1]] == 15  # a second home for the document


def test_a_fully_cached_hot_prefix_spills_once_the_wait_for_a_batch_slot_outgrows_its_saving():
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, max_num_seqs=4,
                                   service_s=20.0), max_inflight=100)
    # No fair share (an unbounded load factor): this is about the batch slots alone.
    b = Balancer(PolicyConfig(affinity=0.8, hash_load_factor=1e9), chunk_size=128, board=board,
                 tokens_per_byte=1.0)
    for w in WORKERS:
        b.add_worker(w, block_size=16)
    p = key(DOC)
    owner, second = b.ring.successors(p.ring_key, 2)
    placed = []
    for _ in range(13):
        d = b.decide(p, now=0.0)
        b.first_byte(b.dispatch(d, p, now=0.0), now=0.0)  # prefill done, decoding goes on
        placed.append(d.worker_id)
    # Requests add almost no prefill (2,432 of 2,470 tokens cached) but each takes a batch slot
    # (4 per worker, 20 s each): the n-th request waits (n - 3) x 5 s for one. The 16x-weighted
    # saving (16 x 2.52 s = 40.4 s) covers 12 in line; the 13th goes to the ring's next worker.
    assert placed[:12] == [owner] * 12
    assert placed[12] == second


def test_affinity_zero_per_request_spreads_a_hot_prefix_by_load():
    b = make()
    p = key(DOC)
    for _ in range(3):
        d = b.decide(p, now=0.0)
        b.dispatch(d, p, now=0.0)
    owner, second = b.ring.successors(p.ring_key, 2)
    d = b.decide(p, now=0.0, affinity=0.0)
    assert (d.worker_id, d.reason) == (second, "ring")  # idle workers tie: the ring breaks it


def test_stored_events_make_predictions_and_removed_or_cleared_ones_withdraw_them():
    b = make()
    p = key(DOC[:2000])
    elsewhere = next(w for w in WORKERS if w != b.ring.owner(p.ring_key))
    b.apply_kv_event(KVEvent(elsewhere, "stored", p.hashes[:10], chunk_size=128, seq=0), now=0.0)
    d = b.decide(p, now=1.0)
    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == (elsewhere, "prefix", 1280)
    b.apply_kv_event(KVEvent(elsewhere, "removed", p.hashes[4:10], chunk_size=128, seq=1), now=2.0)
    assert b.decide(p, now=3.0).predicted_cached_tokens == 512
    b.apply_kv_event(KVEvent(elsewhere, "cleared", [], chunk_size=128, seq=2), now=4.0)
    d = b.decide(p, now=5.0)
    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == (b.ring.owner(p.ring_key), "ring", 0)


def test_events_hashed_with_another_chunk_size_are_ignored_and_gaps_are_counted():
    b = make()
    p = key(DOC)
    assert not b.apply_kv_event(KVEvent("w1", "stored", p.hashes, chunk_size=256), now=0.0)
    assert b.events_ignored == 1
    b.apply_kv_event(KVEvent("w1", "stored", [], chunk_size=128, seq=3), now=0.0)
    b.apply_kv_event(KVEvent("w1", "stored", [], chunk_size=128, seq=7), now=0.0)
    assert b.event_gaps == 1


def test_feedback_below_the_prediction_demotes_the_unproven_entries():
    b = make()
    p = key(DOC[:2000])
    worker = b.ring.owner(p.ring_key)
    b.apply_kv_event(KVEvent(worker, "stored", p.hashes, chunk_size=128), now=0.0)
    d = b.decide(p, now=1.0)
    assert d.predicted_cached_tokens == 1920
    booking = b.dispatch(d, p, now=1.0)
    b.finish(booking, now=2.0, usage=(2000, 512))  # the worker only had 4 chunks' worth
    # Beyond 512 tokens the entries now live only the optimistic TTL (30 s) unless re-stored.
    assert b.decide(p, now=20.0).predicted_cached_tokens == 1920
    assert b.decide(p, now=40.0).predicted_cached_tokens == 512


def test_repeated_misses_clear_what_the_router_believes_about_a_worker():
    b = make(feedback_clear_after=2)
    p = key(DOC[:2000])
    worker = b.ring.owner(p.ring_key)
    b.apply_kv_event(KVEvent(worker, "stored", p.hashes, chunk_size=128), now=0.0)
    for t in (1.0, 2.0):
        booking = b.dispatch(b.decide(p, now=t), p, now=t)
        b.finish(booking, now=t, usage=(2000, 0))
    assert b.index.match(p.hashes, now=3.0) == {}


def test_a_worker_without_kv_events_is_tracked_from_its_responses():
    b = make()
    p = key(DOC[:2000])
    d = b.decide(p, now=0.0)
    b.finish(b.dispatch(d, p, now=0.0), now=1.0, usage=(2000, 0))
    d2 = b.decide(p, now=2.0)
    b.finish(b.dispatch(d2, p, now=2.0), now=3.0, usage=(2000, 1984))
    # Reported hits confirm entries (long TTL) for a worker that sends no events.
    assert b.decide(p, now=600.0).predicted_cached_tokens == 1920


def test_tokens_per_byte_is_learned_per_model_as_an_ema():
    b = make()
    assert b.tokens_per_byte("tiny") == 1.0
    b.observe_prompt_tokens("tiny", num_bytes=1000, prompt_tokens=500)
    assert b.tokens_per_byte("tiny") == 0.5  # the first observation is taken as is
    b.observe_prompt_tokens("tiny", num_bytes=1000, prompt_tokens=1000)
    assert b.tokens_per_byte("tiny") == pytest.approx(0.6)  # 0.5 + 0.2 * (1.0 - 0.5)
    assert b.tokens_per_byte("other") == 1.0


def test_predictions_round_down_to_the_block_and_stay_below_the_prompt():
    b = make()
    p = key(DOC[:2000])
    b.observe_prompt_tokens("tiny", 1000, 250)  # 0.25 tokens per byte
    assert b.cached_tokens_for(3, p, prompt_tokens=500, block_size=16) == 96  # 96 tokens exactly
    assert b.cached_tokens_for(5, p, prompt_tokens=500, block_size=16) == 160  # 160 exactly
    assert b.cached_tokens_for(7, p, prompt_tokens=200, block_size=16) == 192  # capped at 199 -> 192
    assert b.cached_tokens_for(1, p, prompt_tokens=500, block_size=64) == 0  # 32 tokens < a block


def test_reports_from_the_workers_steer_new_requests_away_from_a_busy_one():
    b = make()
    p = key("a brand new prompt " * 20)
    owner = b.ring.owner(p.ring_key)
    b.apply_report(LoadReport(owner, running=4, queued_prefill_tokens=50_000, ts=0.0), now=0.0)
    d = b.decide(p, now=0.0)
    assert d.worker_id != owner and d.reason in ("ring", "least_load")


def test_consistent_hash_walks_the_ring_past_workers_over_the_load_bound():
    b = make(policy="consistent_hash")
    p = key(DOC)
    order = b.ring.successors(p.ring_key, 4)
    d = b.decide(p, now=0.0)
    assert (d.worker_id, d.reason) == (order[0], "hash")
    b.dispatch(d, p, now=0.0)
    b.dispatch(d, p, now=0.0)  # owner: 2 in flight; bound = ceil(1.25 * 3 / 4) = 1
    d = b.decide(p, now=0.0)
    assert (d.worker_id, d.reason) == (order[1], "spill")


def test_round_robin_rotates_through_the_workers_in_order():
    b = make(policy="round_robin")
    p = key(DOC)
    assert [b.decide(p, now=0.0).worker_id for _ in range(5)] == ["w1", "w2", "w3", "w4", "w1"]


def test_excluded_and_unroutable_workers_are_never_chosen():
    b = make()
    p = key(DOC)
    owner = b.ring.owner(p.ring_key)
    assert b.decide(p, now=0.0, exclude={owner}).worker_id != owner
    b.set_routable(owner, False)
    assert b.decide(p, now=0.0).worker_id != owner
    for w in WORKERS:
        b.set_routable(w, False)
    with pytest.raises(NoCapacity):
        b.decide(p, now=0.0)


def test_a_prefix_held_by_many_workers_is_scored_on_its_longest_matches_only():
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, block_size=16))
    b = Balancer(PolicyConfig(match_candidates=2), chunk_size=128, board=board, tokens_per_byte=1.0)
    workers = [f"w{i}" for i in range(12)]
    for w in workers:
        b.add_worker(w, block_size=16)
    p = key(DOC[:2000])
    for w in workers:
        b.apply_kv_event(KVEvent(w, "stored", p.hashes[:3], chunk_size=128), now=0.0)  # a system prompt
    b.apply_kv_event(KVEvent("w9", "stored", p.hashes[:12], chunk_size=128), now=0.0)
    ids, successors = b.candidate_ids(p, b.index.match_top(p.hashes, 1.0, 2)[0], now=1.0)
    assert len(ids) <= 2 + 3 + 2  # not all 12 holders
    d = b.decide(p, now=1.0)
    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == ("w9", "prefix", 1536)
    # Candidates outside the longest matches still get their own (shorter) match: the ring
    # owner is scored with its 3 chunks' bonus, below a cold prefill.
    owner = b.ring.owner(p.ring_key)
    costs = dict(d.costs)
    cold = prefill_seconds(d.prompt_tokens, 0, 1000.0, 32768.0)
    assert owner != "w9" and costs[owner] < cold


def test_the_candidate_set_is_the_prefix_holders_the_ring_successors_and_the_least_backlogged():
    b = make()
    cfg = PolicyConfig(ring_candidates=1, load_candidates=1)
    p = key(DOC[:2000])
    owner = b.ring.owner(p.ring_key)
    holder, busy, idle = (w for w in WORKERS if w != owner)
    b.apply_kv_event(KVEvent(holder, "stored", p.hashes[:4], chunk_size=128), now=0.0)
    for worker_id, tokens in ((owner, 100), (holder, 200), (busy, 5000)):
        b.board.dispatch(worker_id, tokens, now=0.0)
    matches, _ = b.index.match_top(p.hashes, 0.0, cfg.match_candidates)
    ids, successors = b.candidate_ids(p, matches, now=0.0, config=cfg)
    # In this order, without repeats: the prefix holders, the key's ring owner, the emptiest
    # prefill queue; the busy worker is scored by none of the three.
    assert (ids, successors) == ([holder, owner, idle], [owner])
    assert [c.worker_id for c in b.candidate_set(p, matches, 2000, 0.0, frozenset(), cfg)] == ids
    assert [c.ring_rank for c in b.candidate_set(p, matches, 2000, 0.0, frozenset(), cfg)] == [
        NOT_ON_RING, 0, NOT_ON_RING]


def test_a_worker_outside_the_candidate_set_can_be_cheaper_than_every_one_in_it():
    # The set is a heuristic, not a full scan: w_a has the emptiest prefill queue (so it is the
    # one least-loaded candidate) but its single batch slot is taken twice over (4 s of slot wait
    # plus 1 s of fair-share wait); w_b has 0.3 s of prefill queued and free slots. The key's
    # owner is buried under 20 s of prefill. The decision is the best of {owner, w_a}; scoring
    # more of the least-loaded workers finds w_b, cheaper than both.
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, service_s=2.0),
                      max_inflight=10)
    b = Balancer(PolicyConfig(ring_candidates=1, load_candidates=1), chunk_size=128, board=board,
                 tokens_per_byte=1.0)
    for w in WORKERS:
        b.add_worker(w, block_size=16)
    p = key("a prompt nothing holds: " + DOC[:500])
    owner = b.ring.owner(p.ring_key)
    w_a, w_b, w_c = (w for w in WORKERS if w != owner)
    b.apply_report(LoadReport(w_a, max_num_seqs=1, ts=0.0), now=0.0)
    for ticket in (board.dispatch(w_a, 100, now=0.0), board.dispatch(w_a, 100, now=0.0)):
        board.prefilled(ticket, now=0.0)
    board.dispatch(owner, 20_000, now=0.0)
    board.dispatch(w_b, 300, now=0.0)
    board.dispatch(w_c, 600, now=0.0)
    d = b.decide(p, now=0.0)
    cold = prefill_seconds(d.prompt_tokens, 0, 1000.0, 32768.0)
    assert dict(d.costs) == pytest.approx({owner: 20.0 + cold, w_a: 4.0 + 1.0 + cold})
    assert d.worker_id == w_a
    wider = b.decide(p, now=0.0, config=PolicyConfig(ring_candidates=1, load_candidates=4))
    assert (wider.worker_id, wider.cost_s) == (w_b, pytest.approx(0.3 + cold))


def test_new_sessions_sharing_a_system_prompt_one_worker_holds_spread_past_its_fair_share():
    # w1 holds a 256-token system prompt (16 x 0.256 s of locality while it is the only holder).
    # Eight new sessions arrive at once; a request holds its slot ~8 s. Within its fair share of
    # requests in flight (2, bounded-load's ceil(1.25 x 4 / 4)) w1 takes them; the third would
    # wait a fair-share slot turnover (8 s / 2) and goes to an idle worker, which then holds the
    # prompt too -- from there on it is shared, worth only the time it saves, and the sessions
    # spread evenly.
    board = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, service_s=8.0))
    b = Balancer(PolicyConfig(affinity=0.8), chunk_size=128, board=board, tokens_per_byte=1.0)
    for w in WORKERS:
        b.add_worker(w, block_size=16)
    system = DOC[:256]
    b.apply_kv_event(KVEvent("w1", "stored", key(system).hashes, chunk_size=128, seq=1), now=0.0)
    placed = []
    for i in range(8):
        p = key(system + f" user {i}: " + "tell me more. " * 30, session=f"s{i}")
        d = b.decide(p, now=0.0)
        b.dispatch(d, p, now=0.0)
        placed.append(d.worker_id)
    assert placed[:2] == ["w1", "w1"] and "w1" not in placed[2:5]
    assert {w: b.board.get(w).in_system for w in WORKERS} == {"w1": 2, "w2": 2, "w3": 2, "w4": 2}


def test_a_request_finishing_after_its_worker_left_teaches_the_index_nothing():
    # A restarted pod comes back under the same id with an empty cache: the usage of a request
    # that finished on its previous life must not leave "cached" entries for it.
    b = make()
    prompt = key(DOC)
    decision = b.decide(prompt, 0.0)
    booking = b.dispatch(decision, prompt, 0.0)
    b.remove_worker(decision.worker_id)
    b.finish(booking, 1.0, usage=(prompt.num_bytes, prompt.num_bytes - 100))
    b.add_worker(decision.worker_id, block_size=16)
    assert b.index.match(prompt.hashes, 1.0).get(decision.worker_id, 0) == 0
