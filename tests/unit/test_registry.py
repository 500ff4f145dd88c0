"""WorkerRegistry: health states, identities and models, kept in step with the balancer."""
from __future__ import annotations

import pytest

from protocol import LoadReport, WorkerInfo
from router.routing.balancer import Balancer
from router.fleet.registry import (DRAINED, DRAINING, HEALTHY, JOINING, RECOVERING, UNHEALTHY, InvalidWorkerURL,
                             WorkerRegistry)


def registry() -> WorkerRegistry:
    return WorkerRegistry(Balancer(), unhealthy_after=2)


def test_a_worker_is_routable_only_after_its_first_good_probe():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001/", "flag")
    assert (w.url, w.state, reg.balancer.routable()) == ("http://127.0.0.1:9001", JOINING, [])
    reg.mark_ok(w, now=1.0, report=LoadReport("w1", block_size=32, max_num_seqs=8), models=("tiny",))
    assert (w.worker_id, w.state, reg.balancer.routable()) == ("w1", HEALTHY, ["w1"])
    assert reg.balancer.board.get("w1").block_size == 32
    assert reg.models() == ["tiny"]


def test_consecutive_failures_take_a_worker_out_and_good_probes_bring_it_back_through_recovering():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001", "flag")
    reg.mark_ok(w, now=1.0, report=LoadReport("w1"))
    reg.mark_failed(w, "timeout", now=1.5)
    assert w.state == HEALTHY  # one transient error is not enough
    reg.mark_failed(w, "timeout", now=1.6)
    assert (w.state, reg.balancer.routable()) == (UNHEALTHY, [])
    reg.mark_ok(w, now=2.0, report=LoadReport("w1"))  # still within the 1 s cool-down
    assert w.state == UNHEALTHY
    reg.mark_ok(w, now=2.7, report=LoadReport("w1"))  # half-open: routable again, on trial
    assert (w.state, reg.balancer.routable()) == (RECOVERING, ["w1"])
    for t in (3.0, 3.1, 3.2):
        reg.mark_ok(w, now=t, report=LoadReport("w1"))
    assert (w.state, reg.balancer.routable()) == (HEALTHY, ["w1"])


def test_a_draining_worker_gets_no_new_work_whatever_its_probes_say():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001", "flag")
    reg.mark_ok(w, now=1.0, report=LoadReport("w1"))
    reg.drain("w1")
    reg.mark_ok(w, now=2.0, report=LoadReport("w1"))
    assert (w.state, reg.balancer.routable()) == (DRAINING, [])


def test_a_worker_reporting_draining_status_is_drained():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001", "redis", "w1")
    reg.note_info(w, WorkerInfo("w1", "http://127.0.0.1:9001", "tiny", status="draining"))
    assert w.state == DRAINING


def test_one_worker_known_under_two_urls_is_kept_once():
    reg = registry()
    a = reg.add("http://127.0.0.1:9001", "flag")
    b = reg.add("http://localhost:9001", "admin")
    reg.mark_ok(a, now=1.0, report=LoadReport("w1"))
    reg.mark_ok(b, now=1.0, report=LoadReport("w1"))
    assert [w.url for w in reg.all()] == ["http://127.0.0.1:9001"]
    assert reg.add("http://10.0.0.1:9001", "redis", "w1") is a


def test_removing_a_worker_forgets_its_index_entries_and_load():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001", "flag")
    reg.mark_ok(w, now=1.0, report=LoadReport("w1"))
    reg.balancer.index.insert([1, 2], "w1", now=1.0, confirmed=True)
    assert reg.remove("w1") is w
    assert reg.balancer.index.match([1, 2], now=2.0) == {}
    assert "w1" not in reg.balancer.board
    assert reg.remove("w1") is None


def test_workers_that_do_not_serve_a_model_are_excluded_for_it():
    reg = registry()
    a, b = reg.add("http://127.0.0.1:9001", "flag"), reg.add("http://127.0.0.1:9002", "flag")
    reg.mark_ok(a, now=1.0, report=LoadReport("wa"), models=("tiny",))
    reg.mark_ok(b, now=1.0, report=LoadReport("wb"), models=("small",))
    assert reg.excluded_for("tiny") == {"wb"}
    assert reg.excluded_for("small") == {"wa"}
    assert reg.models() == ["small", "tiny"]


@pytest.mark.parametrize("url", ["ftp://host:21", "file:///etc/passwd", "127.0.0.1:9001", "http://", 42])
def test_only_http_urls_are_accepted_as_workers(url):
    with pytest.raises(InvalidWorkerURL):
        registry().add(url, "admin")


def test_an_admin_drain_removes_a_configured_worker_once_nothing_is_in_flight_there():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001", "flag")
    reg.mark_ok(w, now=1.0, report=LoadReport("w1"))
    reg.drain("w1")
    reg.drained(w)
    assert reg.get("w1") is None and "w1" not in reg.balancer.board


def test_an_admin_drain_of_a_discovered_worker_sticks_until_the_admin_adds_it_again():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001", "redis", "w1")
    reg.mark_ok(w, now=1.0, report=LoadReport("w1"))
    reg.balancer.index.insert([1, 2], "w1", now=1.0, confirmed=True)
    reg.drain("w1")
    reg.drained(w)
    assert (w.state, reg.balancer.routable()) == (DRAINED, [])
    assert reg.balancer.index.match([1, 2], now=2.0) == {}  # what it cached is no longer ours to use
    # Discovery keeps seeing it (it still heartbeats, reports ready): it stays out.
    assert reg.add("http://127.0.0.1:9001", "redis", "w1") is w
    reg.note_info(w, WorkerInfo("w1", "http://127.0.0.1:9001", "tiny", status="ready"))
    reg.mark_ok(w, now=3.0, report=LoadReport("w1", status="ready"))
    assert w.state == DRAINED
    assert reg.add("http://127.0.0.1:9001", "admin") is w  # the operator brings it back
    reg.mark_ok(w, now=4.0, report=LoadReport("w1"))
    assert (w.state, reg.balancer.routable()) == (HEALTHY, ["w1"])


def test_a_worker_that_drained_itself_takes_traffic_again_when_it_reports_ready():
    reg = registry()
    w = reg.add("http://127.0.0.1:9001", "flag")
    reg.mark_ok(w, now=1.0, report=LoadReport("w1"))
    reg.mark_ok(w, now=2.0, report=LoadReport("w1", status="draining"))  # SIGTERM
    reg.drained(w)
    assert (w.state, reg.balancer.routable()) == (DRAINED, [])
    reg.mark_ok(w, now=9.0, report=LoadReport("w1", status="ready"))  # restarted at the same address
    assert (w.state, reg.balancer.routable()) == (HEALTHY, ["w1"])


def test_a_worker_that_registers_again_at_a_new_address_moves_there():
    # A rescheduled pod keeps its name (the worker id) and gets a new IP. Before, the old entry
    # kept the id, the new address was never added, and the worker was lost for good.
    reg = registry()
    old = reg.add("http://10.0.0.1:8000", "redis", "w0")
    reg.mark_ok(old, now=1.0, report=LoadReport("w0"))
    reg.mark_failed(old, "refused", now=2.0, refused=True)
    new = reg.add("http://10.0.0.2:8000", "redis", "w0")
    assert new is not old and new.url == "http://10.0.0.2:8000"
    assert reg.get("w0") is new and reg.get("http://10.0.0.1:8000") is None
    reg.mark_ok(new, now=3.0, report=LoadReport("w0"))
    assert reg.balancer.routable() == ["w0"]
    assert reg.add("http://10.0.0.2:8000", "redis", "w0") is new  # the same registration again: no change


def test_a_redis_registration_does_not_move_a_worker_the_operator_listed():
    reg = registry()
    listed = reg.add("http://127.0.0.1:8001", "flag")
    reg.mark_ok(listed, now=1.0, report=LoadReport("w0"))
    assert reg.add("http://localhost:8001", "redis", "w0") is listed  # its advertise URL: one worker, kept as listed
    assert reg.get("w0") is listed
