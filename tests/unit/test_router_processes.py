"""The parts of ``prefixlb router --processes N`` that need no router: merging the processes'
metrics and ledgers (router/http/siblings.py) and the supervisor's restart rules
(prefixlb/processes.py, with stand-in child processes)."""
from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import prefixlb.processes as processes
from router.http.siblings import ProcessSlot, merge_metrics, sum_json


def process_text(requests: int, inflight: int, affinity: float, latency: list[float]) -> str:
    r = CollectorRegistry()
    c = Counter("prefixlb_router_requests_total", "Requests", ["worker"], registry=r)
    c.labels("w1").inc(requests)
    Gauge("prefixlb_router_inflight_requests", "In flight", registry=r).set(inflight)
    Gauge("prefixlb_router_affinity", "Affinity", registry=r).set(affinity)
    h = Histogram("prefixlb_router_request_duration_seconds", "Duration", buckets=(0.1, 1.0), registry=r)
    for v in latency:
        h.observe(v)
    return generate_latest(r).decode()


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_counters_histograms_and_request_gauges_are_summed_state_gauges_get_a_process_label():
    merged = samples(merge_metrics([(0, process_text(3, 1, 0.8, [0.05])), (1, process_text(4, 2, 0.6, [0.5, 2.0]))],
                                   count=2))
    assert merged[("prefixlb_router_requests_total", (("worker", "w1"),))] == 7
    assert merged[("prefixlb_router_inflight_requests", ())] == 3
    assert merged[("prefixlb_router_affinity", (("process", "0"),))] == 0.8
    assert merged[("prefixlb_router_affinity", (("process", "1"),))] == 0.6
    assert ("prefixlb_router_affinity", ()) not in merged
    assert merged[("prefixlb_router_request_duration_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("prefixlb_router_request_duration_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("prefixlb_router_request_duration_seconds_bucket", (("le", "+Inf"),))] == 3
    assert merged[("prefixlb_router_request_duration_seconds_count", ())] == 3
    assert merged[("prefixlb_router_request_duration_seconds_sum", ())] == pytest.approx(2.55)
    assert merged[("prefixlb_router_processes", ())] == 2
    assert merged[("prefixlb_router_processes_answering", ())] == 2


def test_a_process_that_did_not_answer_is_missing_from_the_sum_and_the_answering_gauge_says_so():
    merged = samples(merge_metrics([(1, process_text(4, 0, 0.8, []))], count=3))
    assert merged[("prefixlb_router_requests_total", (("worker", "w1"),))] == 4
    assert merged[("prefixlb_router_processes", ())] == 3
    assert merged[("prefixlb_router_processes_answering", ())] == 1


def test_created_timestamps_take_the_earliest():
    # As prometheus_client writes them: the counter, then its _created as a gauge family.
    a = "# TYPE x_total counter\nx_total 1.0\n# TYPE x_created gauge\nx_created 200.0\n"
    b = "# TYPE x_total counter\nx_total 2.0\n# TYPE x_created gauge\nx_created 100.0\n"
    merged = samples(merge_metrics([(0, a), (1, b)], count=2))
    assert merged[("x_total", ())] == 3 and merged[("x_created", ())] == 100


def test_ledgers_sum_leaf_by_leaf_names_and_strings_from_the_first():
    a = {"price_book": "list", "total": {"requests": 2, "cost_usd": 0.1}, "models": {"m1": {"requests": 2}},
         "overflowed_tenants": 0}
    b = {"price_book": "list", "total": {"requests": 3, "cost_usd": 0.2}, "models": {"m2": {"requests": 3}},
         "overflowed_tenants": 1}
    assert sum_json([a, b]) == {"price_book": "list", "total": {"requests": 5, "cost_usd": 0.3},
                                "models": {"m1": {"requests": 2}, "m2": {"requests": 3}}, "overflowed_tenants": 1}
    assert sum_json([True, False]) is True  # booleans are not numbers


def test_a_slot_names_its_socket_and_its_siblings():
    slot = ProcessSlot(1, 3, "/run/x")
    assert slot.socket(2) == "/run/x/process-2.sock" and slot.others() == [0, 2]


# -- the supervisor, with stand-in children -------------------------------------------------------

class StandIn(processes.Supervisor):
    """Children that run ``script`` (with the slot index in argv) instead of a router."""

    def __init__(self, script: str, count: int = 2) -> None:
        super().__init__(SimpleNamespace(processes=count, port=1, shutdown_grace=1.0))
        self.script = script
        self.started = 0

    async def _start(self, slot):
        slot.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", self.script, self.dir,
                                                         str(slot.index))
        slot.started_at = processes.time.monotonic()
        self.started += 1


READY_THEN_DIE = ("import os, sys, time; d, i = sys.argv[1], sys.argv[2]; "
                  "open(os.path.join(d, f'process-{i}.ready'), 'w').close(); time.sleep(0.05); sys.exit(3)")
FAIL_AT_ONCE = "import sys; sys.exit(2)"


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(processes, "FIRST_BACKOFF_S", 0.01)
    monkeypatch.setattr(processes, "MAX_BACKOFF_S", 0.02)


def test_processes_that_keep_dying_are_restarted_then_the_supervisor_gives_up_with_status_1(fast_backoff):
    sup = StandIn(READY_THEN_DIE)
    assert asyncio.run(asyncio.wait_for(sup.run(), 30)) == 1
    assert len(sup.crashes) == processes.MAX_CRASHES + 1  # the 6th death in the window ends it
    assert processes.MAX_CRASHES + 1 <= sup.started <= processes.MAX_CRASHES + 2  # restarted until then
    assert not os.path.exists(sup.dir)  # the control directory is removed


def test_a_process_that_fails_before_any_listened_ends_the_supervisor_with_its_status(fast_backoff):
    sup = StandIn(FAIL_AT_ONCE)
    assert asyncio.run(asyncio.wait_for(sup.run(), 30)) == 2
    assert sup.started == 2


def test_the_settings_file_is_private():
    sup = StandIn("import time; time.sleep(30)", count=1)

    async def run_then_look():
        task = asyncio.create_task(sup.run())
        path = os.path.join(sup.dir, processes.CONFIG_FILE)
        deadline = asyncio.get_running_loop().time() + 10
        while sup.started < 1:  # the settings are written before the first process starts
            assert asyncio.get_running_loop().time() < deadline, "no process started"
            await asyncio.sleep(0.01)
        assert os.path.exists(path)
        mode = os.stat(path).st_mode & 0o777
        dir_mode = os.stat(sup.dir).st_mode & 0o777
        sup.stopping.set()
        return mode, dir_mode, await task

    assert asyncio.run(run_then_look()) == (0o600, 0o700, 0)
