"""The routing policies as pure functions: crafted situations, exact expected choices.

Unless a test says otherwise: prompts of 1,000 tokens, workers prefilling 1,000 tokens/s, and an
attention knee so large that prefill time is linear (1,000 new tokens = 1.0 s), so every cost
below can be checked by hand.
"""
from __future__ import annotations

import math

import pytest

from router.routing.policies import choose
from router.routing.policy import (NOT_ON_RING, Candidate, NoCapacity, PolicyConfig, RouteRequest,
                                   fair_share_wait_s, hash_load_bound, locality_weight, prefill_seconds)

LINEAR = PolicyConfig(attention_knee_tokens=1e18)


def cand(worker_id: str, cached: int = 0, pending: float = 0.0, rank: int = NOT_ON_RING,
         in_system: int = 0, over_limit: bool = False, service: float = 0.0) -> Candidate:
    return Candidate(worker_id=worker_id, cached_tokens=cached, pending_s=pending, tokens_per_s=1000.0,
                     in_system=in_system, over_limit=over_limit, ring_rank=rank, service_s=service)


def req(affinity: float | None = None, session: bool = False, bound: int = 0) -> RouteRequest:
    return RouteRequest(prompt_tokens=1000, affinity=affinity, session=session, load_bound=bound)


def test_locality_weight_is_the_squared_odds_of_affinity():
    assert locality_weight(0.0) == 0.0
    assert locality_weight(0.2) == pytest.approx(1 / 16)
    assert locality_weight(0.5) == 1.0
    assert locality_weight(0.8) == pytest.approx(16.0)
    assert locality_weight(0.9) == pytest.approx(81.0)
    assert locality_weight(1.0) == math.inf


def test_prefill_time_counts_new_tokens_and_attention_over_the_cached_prefix():
    # 1,000 new tokens over 3,000 cached, knee 4,000: 1 s linear x (1 + (3000 + 500) / 4000).
    assert prefill_seconds(1000, 3000, 1000.0, 4000.0) == pytest.approx(1.875)
    assert prefill_seconds(0, 3000, 1000.0, 4000.0) == 0.0


def test_prefix_cached_on_an_idle_worker_goes_there():
    a, b, c = cand("A", cached=800, rank=0), cand("B", rank=2), cand("C", rank=1)
    decision = choose(req(), [b, a, c], LINEAR)
    assert (decision.worker_id, decision.reason, decision.predicted_cached_tokens) == ("A", "prefix", 800)
    # A: 0 + 1.0 - 16 * 0.8 = -11.8 s; B, C: a cold 1.0 s prefill.
    assert dict(decision.costs) == pytest.approx({"A": -11.8, "B": 1.0, "C": 1.0})


def test_a_long_queue_on_the_owner_sends_the_request_to_the_next_worker_on_the_keys_ring():
    # A holds 800 of 1,000 tokens but has 14 s of work queued: 14 - 11.8 = 2.2 s > 1.0 s cold.
    a = cand("A", cached=800, pending=14.0, rank=0)
    b, c, d = cand("B", rank=2), cand("C", rank=1), cand("D")
    decision = choose(req(), [a, b, c, d], LINEAR)
    assert (decision.worker_id, decision.reason, decision.predicted_cached_tokens) == ("C", "spill", 0)


def test_a_shorter_queue_on_the_owner_still_wins_at_the_default_affinity():
    a = cand("A", cached=800, pending=12.0, rank=0)  # 12 - 11.8 = 0.2 s < 1.0 s
    decision = choose(req(), [a, cand("B", rank=1)], LINEAR)
    assert (decision.worker_id, decision.reason) == ("A", "prefix")


def test_affinity_one_half_compares_plain_predicted_ttft():
    # L = 1: A's TTFT is 0.9 + 0.2 = 1.1 s, B's cold prefill 1.0 s.
    a = cand("A", cached=800, pending=0.9, rank=0)
    decision = choose(req(affinity=0.5), [a, cand("B", rank=1)], LINEAR)
    assert (decision.worker_id, decision.reason) == ("B", "spill")
    assert dict(decision.costs) == pytest.approx({"A": 1.1, "B": 1.0})


def test_affinity_zero_ignores_the_cache_and_takes_the_least_pending_work():
    a = cand("A", cached=800, pending=0.5, rank=0)
    b = cand("B", pending=0.1)
    c = cand("C", pending=0.3, rank=1)
    decision = choose(req(affinity=0.0), [a, b, c], LINEAR)
    assert (decision.worker_id, decision.reason) == ("B", "least_load")


def test_affinity_one_follows_the_cache_however_long_the_queue():
    a = cand("A", cached=800, pending=100.0, rank=0)
    decision = choose(req(affinity=1.0), [a, cand("B", rank=1), cand("C", rank=2)], LINEAR)
    assert (decision.worker_id, decision.reason) == ("A", "prefix")


def test_affinity_one_still_respects_the_hard_limit():
    a = cand("A", cached=800, rank=0, over_limit=True)
    decision = choose(req(affinity=1.0), [a, cand("B", rank=2), cand("C", rank=1)], LINEAR)
    assert (decision.worker_id, decision.reason) == ("C", "spill")


def test_affinity_one_follows_a_longest_match_only_one_worker_holds():
    a = cand("A", cached=400, rank=0)
    b = cand("B", cached=800, pending=3.0, rank=1)
    c = cand("C", cached=300, pending=1.0, rank=2)
    decision = choose(req(affinity=1.0), [a, b, c], LINEAR)
    assert (decision.worker_id, decision.predicted_cached_tokens) == ("B", 800)


def test_affinity_one_places_a_longest_match_several_workers_hold_by_predicted_ttft():
    # B and C both hold 800 tokens: nothing is exclusive, so locality counts only the time it
    # saves (as the limit of a -> 1 does): A's 0.6 s beats C's 1.0 + 0.2 s and B's 3.0 + 0.2 s.
    # (Before exclusivity was measured, a = 1 sent this to C, the less loaded longest match.)
    a = cand("A", cached=400, rank=0)
    b = cand("B", cached=800, pending=3.0, rank=1)
    c = cand("C", cached=800, pending=1.0, rank=2)
    decision = choose(req(affinity=1.0), [a, b, c], LINEAR)
    assert (decision.worker_id, decision.predicted_cached_tokens) == ("A", 400)
    assert dict(decision.costs) == pytest.approx({"A": 0.6, "B": 3.2, "C": 1.2})


def test_only_the_part_of_a_match_no_other_candidate_holds_is_weighted_beyond_its_saving():
    # A holds 800 tokens, B the first 500 of them. A's exclusive 300 tokens are weighted 16x:
    # 10 + 1.0 - (1.0 - 0.5) - 16 x (0.5 - 0.2) = 5.7 s. B's 500 are held by A too: worth the
    # 0.5 s they save, no more, so B (0.6 + 0.5 s) loses to a cold prefill on idle C (1.0 s).
    a = cand("A", cached=800, pending=10.0, rank=0)
    b = cand("B", cached=500, pending=0.6, rank=1)
    c = cand("C", rank=2)
    decision = choose(req(), [a, b, c], LINEAR)
    assert (decision.worker_id, decision.reason) == ("C", "spill")
    assert dict(decision.costs) == pytest.approx({"A": 5.7, "B": 1.1, "C": 1.0})


def test_the_fair_share_wait_is_one_slot_turnover_per_request_beyond_the_share():
    # A fair share of 3 in flight: a 5th request on a worker holding 4 is 2 beyond it.
    assert fair_share_wait_s(in_system=4, service_s=2.0, bound=3) == pytest.approx(2 * 2.0 / 3)
    assert fair_share_wait_s(in_system=2, service_s=2.0, bound=3) == 0.0
    assert fair_share_wait_s(in_system=9, service_s=2.0, bound=0) == 0.0  # no share known


def test_beyond_its_fair_share_a_worker_keeps_long_exclusive_prefixes_but_not_short_ones():
    # A holds 5 requests against a share of 3 (20 s each): 3 x 20 / 3 = 20 s of fair-share
    # wait. Its exclusive 900 tokens are worth 16 x 0.9 = 14.4 s; with a 2 s service time the
    # wait is 2 s and A keeps the request; with 20 s it goes to idle B.
    for service, expected in ((2.0, "A"), (20.0, "B")):
        a = cand("A", cached=900, rank=0, in_system=5, service=service)
        b = cand("B", rank=1, service=service)
        decision = choose(req(bound=3), [a, b], LINEAR)
        assert decision.worker_id == expected
        assert dict(decision.costs)["A"] == pytest.approx(1.0 - 14.4 + 3 * service / 3)


def test_at_twice_its_fair_share_a_worker_takes_nothing_more_whatever_it_holds():
    # The spill allowance is a hard cap (issue 13: a worker lying about its load or cache cannot
    # take the fleet): A holds 6 = 2 x the share of 3, so even its exclusive 900 tokens and a
    # short service time do not bring it this request; B does not compete against it any more.
    a = cand("A", cached=900, rank=0, in_system=6, service=2.0)
    b = cand("B", rank=1, service=2.0)
    decision = choose(req(bound=3), [a, b], LINEAR)
    assert decision.worker_id == "B" and "A" not in dict(decision.costs)
    # ...unless every candidate is at the cap: then the cost decides as before
    b_full = cand("B", rank=1, in_system=6, service=2.0)
    assert choose(req(bound=3), [a, b_full], LINEAR).worker_id == "A"


def test_no_match_anywhere_goes_to_the_ring_owner_among_near_equal_workers():
    # B and C within 5% of each other (1.00 s vs 1.02 s); C owns the key on the ring.
    b, c = cand("B", pending=0.0, rank=1), cand("C", pending=0.02, rank=0)
    decision = choose(req(), [b, c], LINEAR)
    assert (decision.worker_id, decision.reason) == ("C", "ring")
    assert choose(req(session=True), [b, c], LINEAR).reason == "session"


def test_a_clearly_less_loaded_worker_beats_the_ring_owner():
    b, c = cand("B", pending=0.0, rank=1), cand("C", pending=0.5, rank=0)
    decision = choose(req(), [b, c], LINEAR)
    assert (decision.worker_id, decision.reason) == ("B", "least_load")


def test_near_ties_off_the_ring_fall_back_to_the_lowest_cost_then_the_worker_id():
    decision = choose(req(), [cand("Z"), cand("Y", pending=0.01), cand("X")], LINEAR)
    assert (decision.worker_id, decision.reason) == ("X", "least_load")


def test_workers_over_their_hard_limit_never_take_new_work():
    a = cand("A", cached=800, rank=0, over_limit=True)
    decision = choose(req(), [a, cand("B", pending=5.0)], LINEAR)
    assert decision.worker_id == "B"
    with pytest.raises(NoCapacity):
        choose(req(), [a], LINEAR)
    with pytest.raises(NoCapacity):
        choose(req(), [], LINEAR)


def test_predicted_cached_tokens_never_reach_the_whole_prompt():
    # The engine always recomputes the last prompt token, so 1,000 cached of 1,000 costs like 999.
    a = cand("A", cached=1000, rank=0)
    decision = choose(req(), [a, cand("B", rank=1)], LINEAR)
    assert decision.worker_id == "A"
    assert dict(decision.costs)["A"] == pytest.approx(1.0 - 16 * 0.999)


def test_least_load_policy_takes_the_least_pending_work_then_fewer_requests():
    config = PolicyConfig(policy="least_load", attention_knee_tokens=1e18)
    decision = choose(req(), [cand("A", cached=800, pending=0.4), cand("B", pending=0.2, in_system=3),
                              cand("C", pending=0.2, in_system=1)], config)
    assert (decision.worker_id, decision.reason) == ("C", "least_load")


def test_bounded_load_bound_is_the_factor_times_the_mean_load_rounded_up():
    assert hash_load_bound(total_in_system=8, workers=4, factor=1.25) == 3  # ceil(1.25 * 9 / 4)
    assert hash_load_bound(total_in_system=0, workers=4, factor=1.25) == 1


def test_consistent_hash_walks_past_workers_over_the_bound_to_the_next_on_the_ring():
    config = PolicyConfig(policy="consistent_hash")
    ring_order = [cand("A", in_system=3, rank=0), cand("B", in_system=3, rank=1), cand("C", in_system=2, rank=2)]
    decision = choose(req(bound=3), ring_order, config)
    assert (decision.worker_id, decision.reason) == ("C", "spill")
    decision = choose(req(bound=4), ring_order, config)
    assert (decision.worker_id, decision.reason) == ("A", "hash")
    with pytest.raises(NoCapacity):
        choose(req(bound=2), ring_order, config)


def test_round_robin_takes_the_first_candidate_under_its_limit():
    config = PolicyConfig(policy="round_robin")
    decision = choose(req(), [cand("B", over_limit=True), cand("C"), cand("A")], config)
    assert (decision.worker_id, decision.reason) == ("C", "round_robin")


def test_an_unknown_policy_is_an_error():
    with pytest.raises(ValueError):
        choose(req(), [cand("A")], PolicyConfig(policy="random"))
