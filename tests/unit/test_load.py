"""LoadBoard: pending work = last report + what this router sent since, in seconds."""
from __future__ import annotations

import random

import pytest

from protocol import LoadReport
from router.routing.load import LoadBoard, SpeedProfile

PROFILE = SpeedProfile(prefill_tokens_per_s=2000.0, decode_step_s=0.02, max_num_batched_tokens=2000,
                       max_num_seqs=4, block_size=16)


def board(*workers: str, max_inflight: int = 0) -> LoadBoard:
    b = LoadBoard(PROFILE, max_inflight=max_inflight)
    for w in workers:
        b.add_worker(w)
    return b


def test_a_report_sets_pending_work_from_queued_tokens_and_measured_speed():
    b = board("A")
    assert b.apply_report(LoadReport("A", queued_prefill_tokens=4000, prefill_tokens_per_s=1000.0, ts=100.0), now=100.0)
    assert b.pending_s("A", now=100.0) == pytest.approx(4.0)
    assert b.pending_s("A", now=103.0) == pytest.approx(1.0)  # the queue drains as time passes
    assert b.pending_s("A", now=105.0) == 0.0


def test_running_decodes_slow_prefill_down_by_one_decode_step_per_batch():
    b = board("A")
    b.apply_report(LoadReport("A", running=2, queued_prefill_tokens=2000, ts=0.0), now=0.0)
    # Each 2,000-token step also pays a 0.02 s decode step: 1 s of prefill becomes 1.02 s.
    assert b.pending_s("A", now=0.0) == pytest.approx(1.02)


def test_dispatched_work_adds_up_until_its_first_byte_arrives():
    b = board("A")
    t1 = b.dispatch("A", 2000, now=0.0)
    t2 = b.dispatch("A", 1000, now=0.0)
    # Two requests in the system: decode pressure applies (rate 1/(1/2000 + 0.02/2000)).
    rate = 1 / (1 / 2000 + 0.02 / 2000)
    assert b.pending_s("A", now=0.0) == pytest.approx(2000 / rate + 1000 / rate)
    b.prefilled(t1, now=0.5)  # sooner than estimated: what is left is t2's prefill
    assert b.pending_s("A", now=0.5) == pytest.approx(1000 / rate)
    b.finish(t1, now=1.0)
    b.finish(t2, now=1.0)
    assert b.get("A").in_system == 0
    assert b.pending_s("A", now=1.0) == 0.0


def test_a_report_counts_only_requests_sent_after_it_as_unreported():
    b = board("A")
    b.dispatch("A", 2000, now=10.0)   # before the report: the worker already counts it
    b.dispatch("A", 4000, now=12.0)   # after the report: not in it
    b.apply_report(LoadReport("A", running=0, waiting=1, queued_prefill_tokens=2000,
                              prefill_tokens_per_s=2000.0, ts=11.0), now=12.5)
    rate = 1 / (1 / 2000 + 0.02 / 2000)  # requests in the system: decode pressure applies
    assert b.pending_s("A", now=11.0) == pytest.approx((2000 + 4000) / rate)
    assert b.get("A").in_system == 2  # waiting=1 reported + 1 sent since


def test_stale_reports_and_unknown_workers_are_ignored():
    b = board("A")
    assert b.apply_report(LoadReport("A", queued_prefill_tokens=2000, ts=50.0), now=50.0)
    assert not b.apply_report(LoadReport("A", queued_prefill_tokens=99999, ts=40.0), now=51.0)
    assert not b.apply_report(LoadReport("Z", ts=50.0), now=51.0)
    assert b.pending_s("A", now=50.0) == pytest.approx(1.0)


def test_least_loaded_orders_by_prefill_backlog_and_skips_workers_at_their_limit():
    b = board("A", "B", "C", "D", max_inflight=2)
    b.dispatch("A", 3000, now=0.0)
    b.dispatch("B", 1000, now=0.0)
    b.dispatch("C", 2000, now=0.0)
    assert b.least_loaded(3, now=0.0) == ["D", "B", "C"]
    b.dispatch("D", 10, now=0.0)
    b.dispatch("D", 10, now=0.0)  # D reaches its limit of 2
    assert b.get("D").over_limit()
    assert b.least_loaded(3, now=0.0) == ["B", "C", "A"]
    assert b.least_loaded(2, now=0.0, skip={"B"}) == ["C", "A"]


def test_least_loaded_leaves_the_wait_for_a_batch_slot_out_of_its_order():
    # A's prefill queue is empty but its one batch slot is taken twice over (2 requests of ~2 s
    # each in its system: 4 s to wait); B has 0.5 s of prefill queued and free slots. The heap
    # is keyed by the virtual finish time of the prefill backlog only, so A still comes first.
    b = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, max_num_seqs=64, service_s=2.0),
                  max_inflight=10)
    b.add_worker("A", max_num_seqs=1)
    b.add_worker("B")
    for ticket in (b.dispatch("A", 100, now=0.0), b.dispatch("A", 100, now=0.0)):
        b.prefilled(ticket, now=0.0)
    b.dispatch("B", 500, now=0.0)
    assert (b.pending_s("A", now=0.0), b.pending_s("B", now=0.0)) == pytest.approx((4.0, 0.5))
    assert b.least_loaded(1, now=0.0) == ["A"]
    assert b.least_loaded(2, now=0.0) == ["A", "B"]


def test_unroutable_workers_are_not_offered_but_keep_their_load():
    b = board("A", "B")
    b.dispatch("A", 1000, now=0.0)
    b.set_routable("B", False)
    assert b.least_loaded(2, now=0.0) == ["A"]
    b.set_routable("B", True)
    assert b.least_loaded(2, now=0.0) == ["B", "A"]


def test_the_hard_limit_defaults_to_twice_the_reported_batch_size():
    b = board("A")
    assert b.get("A").max_inflight == 8  # profile max_num_seqs 4
    b.apply_report(LoadReport("A", max_num_seqs=16, ts=0.0), now=0.0)
    assert b.get("A").max_inflight == 32


def test_total_in_system_follows_dispatches_finishes_and_removals():
    b = board("A", "B")
    t = b.dispatch("A", 10, now=0.0)
    b.dispatch("B", 10, now=0.0)
    b.dispatch("B", 10, now=0.0)
    assert b.total_in_system == 3
    b.finish(t, now=1.0)
    assert b.total_in_system == 2
    b.remove_worker("B")
    assert b.total_in_system == 0


def test_a_worker_whose_kv_cache_is_full_makes_new_requests_wait_for_a_slot():
    # 10 running requests hold 90,000 of 100,000 KV tokens: ~11.1 such requests fit, far fewer
    # than its 64 batch slots. 15 in the system: a new one waits 4.89 slot turnovers of 2 s / 11.1.
    b = LoadBoard(SpeedProfile(prefill_tokens_per_s=2000.0, max_num_seqs=64, service_s=2.0))
    b.add_worker("A")
    b.apply_report(LoadReport("A", running=10, waiting=5, running_tokens=90_000, capacity_tokens=100_000,
                              ts=0.0), now=0.0)
    slots = 10 * 100_000 / 90_000
    assert b.get("A").slots() == pytest.approx(slots)
    assert b.pending_s("A", now=0.0) == pytest.approx((15 + 1 - slots) * 2.0 / slots)
    # The same load with room in the cache: the batch limit applies, and 64 slots are free.
    b.apply_report(LoadReport("A", running=10, waiting=5, running_tokens=9_000, capacity_tokens=100_000,
                              ts=1.0), now=1.0)
    assert b.pending_s("A", now=1.0) == 0.0


def test_a_late_report_does_not_count_again_what_prefilled_or_finished_after_its_timestamp():
    b = board("A")
    t1 = b.dispatch("A", 2000, now=10.0)
    b.dispatch("A", 1000, now=10.0)
    b.prefilled(t1, now=11.5)
    b.finish(t1, now=12.0)
    # Stamped 11.0 (both requests waiting, 3,000 tokens queued), it arrives at 12.5: t1 has
    # prefilled and finished since, so only t2 is in the system and only its 1,000 tokens queued.
    b.apply_report(LoadReport("A", waiting=2, queued_prefill_tokens=3000, ts=11.0), now=12.5)
    rate = 1 / (1 / 2000 + 0.02 / 2000)
    assert b.get("A").in_system == 1
    assert b.pending_s("A", now=11.0) == pytest.approx(1000 / rate)


def test_a_requests_slot_time_counts_from_the_start_of_its_prefill_not_its_wait_in_the_queue():
    b = LoadBoard(SpeedProfile(prefill_tokens_per_s=1000.0, decode_step_s=0.0, service_s=2.0))
    b.add_worker("A")
    t = b.dispatch("A", 1000, now=0.0)   # 1 s of prefill
    b.prefilled(t, now=5.0)              # it waited 4 s in the worker's queue
    b.finish(t, now=8.0)                 # held a slot from 4.0 to 8.0
    assert b.get("A").service_s == pytest.approx(2.0 + 0.2 * (4.0 - 2.0))


def test_the_cached_load_of_each_worker_always_equals_its_definition():
    # The candidate set reads rate_now / slot_wait_s / over_limit_now instead of calling rate(),
    # slot_wait() and over_limit() on every decision: every change the board makes must refresh
    # them, exactly (the same floats, or decisions would change).
    rng = random.Random(7)
    b = LoadBoard(PROFILE, max_inflight=6)
    for w in "ABC":
        b.add_worker(w)
    tickets = []
    now = 0.0
    for _ in range(2000):
        now += rng.random() * 0.05
        w = rng.choice("ABC")
        op = rng.randrange(6)
        if op == 0:
            report = LoadReport(w, running=rng.randrange(5), waiting=rng.randrange(3),
                                queued_prefill_tokens=rng.randrange(5000), running_tokens=rng.randrange(40_000),
                                capacity_tokens=rng.choice((0, 20_000, 60_000)),
                                max_num_seqs=rng.choice((0, 2, 4)),
                                prefill_tokens_per_s=rng.choice((0.0, 1500.0, 3000.0)), ts=now)
            b.apply_report(report, now=now)
        elif op in (1, 2):
            tickets.append(b.dispatch(w, rng.randrange(1, 3000), now))
        elif op == 3 and tickets:
            b.prefilled(rng.choice(tickets), now)
        elif op == 4 and tickets:
            b.finish(tickets.pop(rng.randrange(len(tickets))), now)
        elif op == 5:
            b.set_cap(w, rng.choice((0, 1, 3)))
        for load in (b.get(x) for x in "ABC"):
            assert (load.rate_now, load.slot_wait_s, load.over_limit_now) == (
                load.rate(), load.slot_wait(), load.over_limit())
