"""Admission: the router's global in-flight limit and a bounded queue for requests that must wait.

A request waits here when it cannot be sent now: the router already has ``max_inflight``
requests in flight (global limit), or every candidate worker is at its own hard limit
(``NoCapacity`` from the policy). It waits in a FIFO queue, bounded in count (``max_queue``)
and in body bytes (``max_queue_bytes``), for at most ``queue_timeout_s``; every finished
request wakes the first waiter of each kind -- the first waiting for a global slot and the first
that holds one and waits for a worker -- which try again: a finished request frees both, and a
waiter of one kind cannot use what the other needs (a request for another model's worker, or one
that already holds its global slot). Only requests waiting for a global slot keep a new arrival
from taking a free one (first come, first served). A request that finds the queue full, or
whose wait times out, is refused with :class:`Overloaded` (429 + ``Retry-After``) -- so
overload costs bounded memory and a bounded wait, never an unbounded backlog.

All on one event loop; no locks.
"""
from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass

from protocol.openai_api import OpenAIError

RETRY_AFTER_S = 1


class Overloaded(OpenAIError):
    """The router cannot take the request now: 429 with ``Retry-After``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(429, message, "rate_limit_error", None, "overloaded")
        self.reason = reason


@dataclass(slots=True, eq=False)
class _Waiter:
    future: asyncio.Future
    size: int
    holds_slot: bool = False  # waits for a worker, not for a global slot


@dataclass(slots=True)
class AdmissionStats:
    """Counters for the metrics endpoint."""

    queued: int = 0
    rejected_full: int = 0
    rejected_timeout: int = 0
    rejected_inflight: int = 0


class Admission:
    """Global in-flight count plus the wait queue (see the module docstring)."""

    def __init__(self, max_inflight: int = 0, max_queue: int = 256, max_queue_bytes: int = 64 << 20,
                 queue_timeout_s: float = 5.0) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.queue_timeout_s = queue_timeout_s
        self.inflight = 0
        self.queued_bytes = 0
        self.stats = AdmissionStats()
        self._waiters: deque[_Waiter] = deque()
        self._slot_waiters = 0  # queued waiters without a global slot

    def __len__(self) -> int:
        """Requests waiting in the queue now."""
        return len(self._waiters)

    def deadline(self, now: float) -> float:
        """The latest a request arriving at ``now`` (loop time) may wait until."""
        return now + self.queue_timeout_s

    def try_enter(self, woken: bool = False) -> bool:
        """Take a global in-flight slot if one is free (and nobody queued first); True if taken."""
        if self.max_inflight > 0 and self.inflight >= self.max_inflight:
            return False
        if self._slot_waiters and not woken:
            return False  # first come, first served
        self.inflight += 1
        return True

    def leave(self) -> None:
        """A request admitted by :meth:`try_enter` is done: its slot goes to the next waiter."""
        self.inflight -= 1
        self.notify()

    def notify(self) -> None:
        """Capacity may have freed up (a request finished, a worker came back): wake the first
        waiter of each kind (one for a global slot, one for a worker)."""
        woke: set[bool] = set()
        skipped: list[_Waiter] = []
        # The kinds queued now: no scan past the first waiter when every waiter is of one kind.
        kinds = {False} if self._slot_waiters else set()
        if len(self._waiters) > self._slot_waiters:
            kinds.add(True)
        while self._waiters and not kinds <= woke:
            waiter = self._waiters.popleft()
            if not waiter.future.done() and waiter.holds_slot in woke:
                skipped.append(waiter)
                continue
            self._unqueued(waiter)
            if not waiter.future.done():
                waiter.future.set_result(None)
                woke.add(waiter.holds_slot)
        self._waiters.extendleft(reversed(skipped))

    async def wait(self, size: int, deadline: float, front: bool = False, holds_slot: bool = False) -> None:
        """Wait for :meth:`notify` in the queue; raises :class:`Overloaded` if full or at ``deadline``.

        ``front``: a request that was woken but still found no capacity keeps its place at the
        head of the queue instead of going to the back. ``holds_slot``: the request already holds
        a global slot and waits for a worker.
        """
        loop = asyncio.get_running_loop()
        timeout = deadline - loop.time()
        if self.max_queue <= 0 or len(self._waiters) >= self.max_queue \
                or self.queued_bytes + size > self.max_queue_bytes:
            self.stats.rejected_full += 1
            raise Overloaded(f"The router is at capacity and its queue is full; retry in {RETRY_AFTER_S} s",
                             "queue_full")
        if timeout <= 0:
            self.stats.rejected_timeout += 1
            raise Overloaded(_timeout_message(self.queue_timeout_s), "queue_timeout")
        waiter = _Waiter(loop.create_future(), size, holds_slot)
        if front:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        self.queued_bytes += size
        if not holds_slot:
            self._slot_waiters += 1
        self.stats.queued += 1
        try:
            # Not wait_for: on Python 3.11 it swallows a cancel that arrives as the waiter is woken.
            async with asyncio.timeout(timeout):
                await waiter.future
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return  # woken at the deadline: it takes its turn
            self._discard(waiter)
            self.stats.rejected_timeout += 1
            raise Overloaded(_timeout_message(self.queue_timeout_s), "queue_timeout") from None
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.notify()  # it was woken but will not use the capacity: pass it on
            else:
                self._discard(waiter)
            raise

    def _discard(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return  # already popped by notify()
        self._unqueued(waiter)

    def _unqueued(self, waiter: _Waiter) -> None:
        self.queued_bytes -= waiter.size
        if not waiter.holds_slot:
            self._slot_waiters -= 1


def _timeout_message(timeout_s: float) -> str:
    return (f"The router is at capacity: no worker could take the request within "
            f"{math.ceil(timeout_s)} s; retry in {RETRY_AFTER_S} s")
