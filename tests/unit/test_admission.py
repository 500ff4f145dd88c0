"""Admission control: the global in-flight limit and the bounded FIFO queue for overload."""
from __future__ import annotations

import asyncio
import time

import pytest

from router.http.admission import Admission, Overloaded


async def _enter(adm: Admission, size: int = 10) -> None:
    """What the proxy does: take a slot, or wait in the queue for one."""
    loop = asyncio.get_running_loop()
    deadline = adm.deadline(loop.time())
    woken = False
    while not adm.try_enter(woken):
        await adm.wait(size, deadline, front=woken)
        woken = True


async def test_requests_beyond_the_global_limit_wait_and_are_served_in_arrival_order():
    adm = Admission(max_inflight=1, max_queue=8, queue_timeout_s=10)
    await _enter(adm)
    order: list[int] = []

    async def request(i: int) -> None:
        await _enter(adm)
        order.append(i)
        adm.leave()

    tasks = [asyncio.create_task(request(i)) for i in range(3)]
    while len(adm) < 3:
        await asyncio.sleep(0)
    assert (adm.inflight, order) == (1, [])
    adm.leave()
    await asyncio.gather(*tasks)
    assert (order, adm.inflight, len(adm), adm.queued_bytes) == ([0, 1, 2], 0, 0, 0)


async def test_a_full_queue_refuses_at_once_with_a_429():
    adm = Admission(max_inflight=1, max_queue=1, queue_timeout_s=10)
    await _enter(adm)
    waiting = asyncio.create_task(_enter(adm))
    while len(adm) < 1:
        await asyncio.sleep(0)
    with pytest.raises(Overloaded) as refused:
        await _enter(adm)
    assert (refused.value.status, refused.value.reason, refused.value.code) == (429, "queue_full", "overloaded")
    adm.leave()
    await waiting


async def test_the_queue_is_bounded_in_bytes_too():
    adm = Admission(max_inflight=1, max_queue=100, max_queue_bytes=1000, queue_timeout_s=10)
    await _enter(adm)
    waiting = asyncio.create_task(_enter(adm, size=600))
    while len(adm) < 1:
        await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await _enter(adm, size=600)
    adm.leave()
    await waiting


async def test_a_request_waits_at_most_the_queue_timeout():
    adm = Admission(max_inflight=1, max_queue=8, queue_timeout_s=0.05)
    await _enter(adm)
    with pytest.raises(Overloaded) as refused:
        await _enter(adm)
    assert refused.value.reason == "queue_timeout"
    assert (len(adm), adm.queued_bytes, adm.stats.rejected_timeout) == (0, 0, 1)


async def test_a_request_cancelled_as_it_is_woken_stays_cancelled_and_passes_its_turn_on():
    # Python 3.11's wait_for returns the result of a future that completed in the same loop turn
    # as the cancel, swallowing it: the disconnected client's request went on to a worker.
    adm = Admission(max_inflight=1, max_queue=8, queue_timeout_s=10)
    await _enter(adm)
    first = asyncio.create_task(_enter(adm))
    second = asyncio.create_task(_enter(adm))
    while len(adm) < 2:
        await asyncio.sleep(0)
    adm.leave()  # wakes `first` ...
    first.cancel()  # ... whose client disconnects before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the turn went on to the next in line
    assert (adm.inflight, len(adm), adm.queued_bytes) == (1, 0, 0)


async def test_a_request_woken_at_its_deadline_takes_its_turn():
    adm = Admission(max_inflight=1, max_queue=8, queue_timeout_s=0.05)
    await _enter(adm)
    waiting = asyncio.create_task(_enter(adm))
    while len(adm) < 1:
        await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    loop.call_at(loop.time() + 0.04, adm.leave)  # the wake, just before the deadline ...
    time.sleep(0.2)  # ... and the timeout run in the same loop turn, before the waiter does
    await waiting  # woken: it is not refused (and the slot is not lost)
    assert (adm.inflight, len(adm)) == (1, 0)


async def test_a_finished_request_wakes_the_first_waiter_of_each_kind():
    # One waiter already holds a global slot and waits for a worker; one waits for a global slot.
    # A finished request frees both: neither wake may be spent on the waiter that cannot use it.
    adm = Admission(max_inflight=2, max_queue=8, queue_timeout_s=10)
    await _enter(adm)
    await _enter(adm)  # this one waits for a worker, holding its slot
    loop = asyncio.get_running_loop()
    for_worker = asyncio.create_task(adm.wait(10, adm.deadline(loop.time()), holds_slot=True))
    for_slot = asyncio.create_task(_enter(adm))
    while len(adm) < 2:
        await asyncio.sleep(0)
    adm.leave()
    await asyncio.wait_for(asyncio.gather(for_worker, for_slot), 1)
    assert (adm.inflight, len(adm), adm.queued_bytes) == (2, 0, 0)


async def test_waiters_for_a_worker_do_not_hold_back_a_new_request_with_a_free_slot():
    adm = Admission(max_inflight=4, max_queue=8, queue_timeout_s=10)
    await _enter(adm)
    loop = asyncio.get_running_loop()
    for_worker = asyncio.create_task(adm.wait(10, adm.deadline(loop.time()), holds_slot=True))
    while len(adm) < 1:
        await asyncio.sleep(0)
    assert adm.try_enter()  # it already holds its slot; a new arrival takes a free one at once
    for_worker.cancel()
