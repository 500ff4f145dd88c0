"""Circuit breakers: the pure state machine, and what the registry does when one opens or closes."""
from __future__ import annotations

from protocol import LoadReport
from router.routing.balancer import Balancer
from router.fleet.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerConfig
from router.fleet.registry import HEALTHY, RECOVERING, UNHEALTHY, WARMING, WorkerRegistry

CONFIG = BreakerConfig(failure_threshold=3, cool_down_s=1.0, max_cool_down_s=5.0, half_open_successes=2)


def test_only_consecutive_failures_open_the_breaker():
    b = Breaker(CONFIG)
    for t in range(10):  # failures interleaved with successes: transient, never enough
        assert b.record_failure(float(t)) is False
        assert b.record_failure(t + 0.1) is False
        b.record_success(t + 0.2)
    assert (b.state, b.failures, b.opens) == (CLOSED, 0, 0)
    assert [b.record_failure(20.0 + i) for i in range(3)] == [False, False, True]
    assert (b.state, b.opened_at, b.opens) == (OPEN, 22.0, 1)


def test_a_refused_connection_opens_the_breaker_at_once():
    b = Breaker(CONFIG)
    assert b.record_failure(1.0, certain=True) is True  # nothing listens there: not a transient error
    assert (b.state, b.opens) == (OPEN, 1)


def test_an_open_breaker_half_opens_on_the_first_good_probe_after_its_cool_down():
    b = Breaker(CONFIG)
    for i in range(3):
        b.record_failure(10.0)
    assert b.record_probe_ok(10.5) is False  # cooling down: a good probe proves little yet
    assert b.record_success(10.6) is False  # nor does a request that was already in flight
    assert b.state == OPEN
    assert b.record_probe_ok(11.0) is True
    assert b.state == HALF_OPEN


def test_successes_close_a_half_open_breaker_and_one_failure_reopens_it_for_twice_as_long():
    b = Breaker(CONFIG)
    for _ in range(3):
        b.record_failure(0.0)
    b.record_probe_ok(1.0)
    assert b.record_failure(1.5) is True  # a single failure on trial is enough
    assert (b.state, b.cool_down_s, b.opens) == (OPEN, 2.0, 2)
    assert b.record_probe_ok(3.0) is False  # 1.5 s later: the doubled cool-down is not over
    assert b.record_probe_ok(3.5) is True
    b.record_failure(3.6)
    assert b.cool_down_s == 4.0
    assert b.record_probe_ok(8.0) is True
    b.record_failure(8.0)
    assert b.cool_down_s == 5.0  # capped at max_cool_down_s
    assert b.record_probe_ok(13.0) is True
    assert [b.record_success(13.0), b.record_success(13.1)] == [False, True]
    assert (b.state, b.cool_down_s) == (CLOSED, 1.0)  # a closed breaker forgets the back-off


def _registry(warmup=None) -> tuple[WorkerRegistry, object]:
    reg = WorkerRegistry(Balancer(), breaker=CONFIG, half_open_max_inflight=1, warmup=warmup)
    w = reg.add("http://127.0.0.1:9001", "flag")
    reg.mark_ok(w, now=0.0, report=LoadReport("w1", max_num_seqs=8))
    return reg, w


def test_an_opening_breaker_drops_the_workers_index_entries_and_abandons_its_requests():
    reg, w = _registry()
    aborted = []
    reg.on_unavailable.append(aborted.append)
    reg.balancer.index.insert([11, 12, 13], "w1", now=0.0, confirmed=True)
    for t in (1.0, 1.1, 1.2):
        reg.mark_failed(w, "connect", now=t)
    assert (w.state, reg.balancer.routable(), aborted) == (UNHEALTHY, [], ["w1"])
    # Its keys are free for their ring neighbours: nothing predicts a hit there any more.
    assert reg.balancer.index.match([11, 12, 13], now=2.0) == {}


def test_a_recovering_worker_takes_a_capped_share_until_requests_succeed_there():
    reg, w = _registry()
    for t in (1.0, 1.1, 1.2):
        reg.mark_failed(w, "timeout", now=t)
    reg.mark_ok(w, now=2.5, report=LoadReport("w1", max_num_seqs=8))
    assert w.state == RECOVERING
    load = reg.balancer.board.get("w1")
    assert load.over_limit() is False
    ticket = reg.balancer.board.dispatch("w1", 10, now=2.6)
    assert load.over_limit() is True  # half-open: one trial request at a time from this router
    reg.balancer.board.finish(ticket, now=2.7)
    reg.request_ok("w1", now=2.7)
    reg.request_ok("w1", now=2.8)
    assert w.state == HEALTHY
    reg.balancer.board.dispatch("w1", 10, now=2.9)
    assert load.over_limit() is False  # closed: only the hard limit (2 x 8) applies again


def test_a_failed_trial_takes_a_recovering_worker_out_again():
    reg, w = _registry()
    for t in (1.0, 1.1, 1.2):
        reg.mark_failed(w, "timeout", now=t)
    reg.mark_ok(w, now=2.5, report=LoadReport("w1"))
    reg.mark_failed(w, "status", now=2.6)
    assert (w.state, reg.balancer.routable(), w.breaker.cool_down_s) == (UNHEALTHY, [], 2.0)


def test_a_worker_coming_back_from_a_failure_is_prewarmed_before_its_trial_requests():
    warming, done = [], []

    def warmup(worker, warmed) -> bool:  # "I will warm it, then call warmed(worker)"
        if worker.state != UNHEALTHY:
            return False  # nothing hot yet when it first joined
        warming.append(worker.worker_id)
        done.append(warmed)
        return True

    reg, w = _registry(warmup)
    for t in (1.0, 1.1, 1.2):
        reg.mark_failed(w, "timeout", now=t)
    reg.mark_ok(w, now=2.5, report=LoadReport("w1"))
    assert (w.state, warming, reg.balancer.routable()) == (WARMING, ["w1"], [])
    done[0](w)
    assert (w.state, reg.balancer.routable()) == (RECOVERING, ["w1"])
