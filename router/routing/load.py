"""LoadBoard: each worker's pending work in seconds = its last report + what we sent since.

Pending prefill work is kept as a *virtual finish time* ``busy_until``: the moment the worker's
known prefill backlog is done if it runs at its measured speed. It is set from a load report
(``report time + queued tokens / rate``), pushed forward when this router dispatches a request
there, and pulled back when a request's first byte shows its prefill is done. Because the
backlog at ``now`` is ``max(0, busy_until - now)``, ordering workers by ``busy_until`` orders
them by prefill backlog at *any* ``now`` -- so a heap on it answers "the k workers with the
least prefill backlog" (:meth:`LoadBoard.least_loaded`) in O(k log n) without re-keying as time
passes (the fleet simulator asks this for 1,000 workers a million times). It is not "the least
pending work": the slot wait below is left out of the key, because it changes with every
dispatch and finish, and a clamped backlog plus a wait has no order that holds at every ``now``.

Decode pressure: with continuous batching a prefill shares each step with the running decodes,
so a step that prefills ``B = max_num_batched_tokens`` tokens also pays ``decode_step_s``. The
effective prefill rate is therefore ``1 / (1/prefill_tokens_per_s + decode_step_s / B)`` while
anything is running, and the plain measured rate on an idle worker.

Waiting for a slot: a worker runs at most ``slots`` requests at once, so a request that arrives
when they are taken waits for running ones to finish -- about ``service_s / slots`` per request
ahead of it, with ``service_s`` the worker's mean time a request holds a slot (from the start of
its prefill to its finish: an EMA over what this router saw). ``slots`` is the batch limit
``max_num_seqs``, or fewer when the KV cache is the limit: the requests of the reported running
batch's mean context that fit the worker's KV capacity. This is what makes a hot, fully cached
prefix spill (its requests add almost no prefill, but they fill the batch), and what makes a
decode-heavy worker whose cache is full of long conversations look as busy as it is: its
queued requests wait for blocks, not for prefill compute.

The hard limit (a safety net, design.md section 4): a worker with ``max_inflight`` requests in
its system (running + waiting, by its report, plus what we sent since) takes no new work.

No I/O and no clock: every method takes ``now``.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from protocol import LoadReport


# What any one engine replica can do (H100 class and well beyond): reports outside are clamped.
MIN_PREFILL_TOKENS_PER_S, MAX_PREFILL_TOKENS_PER_S = 1.0, 2_000_000.0
MIN_DECODE_STEP_S, MAX_DECODE_STEP_S = 1e-4, 60.0
MAX_NUM_SEQS = 4096
# A CPU KV tier's load rate: from a slow PCIe link and a 70B model's KV (~1K tokens/s) to
# NVLink-C2C and a small model's; beyond that a report is clamped.
MIN_TRANSFER_TOKENS_PER_S, MAX_TRANSFER_TOKENS_PER_S = 1_000.0, 1e9
RATE_CAP_FACTOR = 4.0  # a worker's prefill speed is believed up to this many times the fleet's median


def _clamp(value: float, low: float, high: float) -> float:
    """``value`` within [low, high]; 0 (or less, or NaN) stays 0: "not measured"."""
    if not value > 0:
        return 0.0
    return low if value < low else high if value > high else value


@dataclass(slots=True)
class SpeedProfile:
    """A worker's speed before it has measured (and fallbacks for zeros in reports)."""

    prefill_tokens_per_s: float = 4000.0
    decode_step_s: float = 0.02
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    service_s: float = 2.0  # mean dispatch -> finish time until measured
    # CPU KV tier load rate of a worker that announces ``cpu`` blocks but no rate: Llama-3-8B's
    # 128 KiB of KV per token over PCIe 4.0's ~25 GB/s.
    transfer_tokens_per_s: float = 190_000.0


@dataclass(slots=True, eq=False)
class Ticket:
    """One dispatched request, from dispatch until it finishes."""

    worker_id: str
    sent_at: float
    prefill_tokens: int
    work_s: float = 0.0  # its prefill time as estimated at dispatch
    eta: float = 0.0  # when its prefill was estimated to be done
    prefilled_at: float | None = None  # its first byte
    prefilled: bool = False
    finished: bool = False


@dataclass(slots=True, eq=False)
class WorkerLoad:
    """What the board knows about one worker."""

    worker_id: str
    prefill_tokens_per_s: float
    decode_step_s: float
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    max_inflight: int
    service_s: float
    report_at: float = -math.inf
    reported_in_system: int = 0
    reported_running: int = 0
    busy_until: float = 0.0
    sent_since_report: int = 0
    finished_since_report: int = 0
    tickets: set[Ticket] = field(default_factory=set)
    in_system: int = 0
    heap_version: int = 0
    # (time, sent_at, prefill tokens, finished) of recent first bytes and finishes: what a report
    # stamped before them still counts as queued or running
    recent: deque[tuple[float, float, int, bool]] = field(default_factory=lambda: deque(maxlen=1024))
    capacity_tokens: int = 0  # KV capacity, by its report (0: unknown)
    reported_running_tokens: int = 0
    routable: bool = True
    cap: int = 0  # while > 0, at most this many of this router's requests at once (breaker half-open)
    transfer_tokens_per_s: float = 0.0  # its CPU KV tier's load rate, by its report (0: unknown)
    # ``rate()``, the slot wait of ``pending_s`` and ``over_limit()`` as of the last change: the
    # candidate set reads them for every candidate of every decision, and they change only when
    # the board changes the worker (``LoadBoard._refresh``), not as time passes.
    rate_now: float = 0.0
    slot_wait_s: float = 0.0
    over_limit_now: bool = False

    def rate(self) -> float:
        """Effective prefill tokens per second, decode pressure included."""
        base = 1.0 / self.prefill_tokens_per_s
        if self.in_system > 0 or self.reported_running > 0:
            base += self.decode_step_s / max(1, self.max_num_batched_tokens)
        return 1.0 / base

    def slots(self) -> float:
        """Requests it can run at once: ``max_num_seqs``, or what its KV cache holds if fewer."""
        seqs = self.max_num_seqs
        running, tokens = self.reported_running, self.reported_running_tokens
        if self.capacity_tokens > 0 and running > 0 and tokens > 0:
            kv = running * self.capacity_tokens / tokens
            if kv < seqs:
                return kv if kv > 1.0 else 1.0
        return float(seqs)

    def pending_s(self, now: float) -> float:
        """Seconds before a new request's prefill can start: prefill backlog + slot wait."""
        backlog = self.busy_until - now
        return (backlog if backlog > 0.0 else 0.0) + self.slot_wait()

    def slot_wait(self) -> float:
        """Seconds a new request waits for a batch slot (0 while one is free)."""
        slots = self.slots()
        ahead = self.in_system + 1 - slots
        return ahead * self.service_s / slots if ahead > 0 else 0.0

    def over_limit(self) -> bool:
        """True when the worker is at its hard in-flight limit (or at its trial cap)."""
        return self.in_system >= self.max_inflight or (self.cap > 0 and len(self.tickets) >= self.cap)


def refresh_python(w: WorkerLoad) -> None:
    """Bring ``w``'s cached ``rate_now``, ``slot_wait_s`` and ``over_limit_now`` up to date (Python)."""
    # WorkerLoad.rate(), slot_wait() (with slots()) and over_limit() written out, the same
    # expressions in the same order (so the same floats): every dispatch, first byte, finish and
    # report refreshes them, millions of times in a simulated run. (``_refresh`` below: this, or
    # the same in C where router/routing/_hotloop.c was built; tests/unit/test_hotloop.py.)
    base = 1.0 / w.prefill_tokens_per_s
    in_system = w.in_system
    running = w.reported_running
    if in_system > 0 or running > 0:
        batched = w.max_num_batched_tokens
        base += w.decode_step_s / (batched if batched > 1 else 1)
    w.rate_now = 1.0 / base
    slots = float(w.max_num_seqs)
    tokens = w.reported_running_tokens
    if w.capacity_tokens > 0 and running > 0 and tokens > 0:
        kv = running * w.capacity_tokens / tokens
        if kv < w.max_num_seqs:
            slots = kv if kv > 1.0 else 1.0
    ahead = in_system + 1 - slots
    w.slot_wait_s = ahead * w.service_s / slots if ahead > 0 else 0.0
    w.over_limit_now = in_system >= w.max_inflight or (w.cap > 0 and len(w.tickets) >= w.cap)


_refresh = refresh_python  # router.routing.hotloop puts the compiled one here where it was built


class LoadBoard:
    """Per-worker load estimates and a least-loaded heap. No I/O."""

    def __init__(self, profile: SpeedProfile | None = None, max_inflight: int = 0,
                 max_report_age_s: float = 30.0, service_alpha: float = 0.2) -> None:
        self.profile = profile or SpeedProfile()
        self.service_alpha = service_alpha
        self.max_inflight = max_inflight
        self.max_report_age_s = max_report_age_s
        self._workers: dict[str, WorkerLoad] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._counter = itertools.count()
        self.total_in_system = 0
        self._cap_rate, self._cap_rate_at = math.inf, -math.inf

    # -- membership ---------------------------------------------------------------------------
    def add_worker(self, worker_id: str, block_size: int | None = None,
                   max_num_seqs: int | None = None) -> WorkerLoad:
        """Track ``worker_id`` (idempotent); returns its load record."""
        w = self._workers.get(worker_id)
        if w is not None:
            return w
        p = self.profile
        seqs = max_num_seqs or p.max_num_seqs
        w = WorkerLoad(worker_id, p.prefill_tokens_per_s, p.decode_step_s, p.max_num_batched_tokens,
                       seqs, block_size or p.block_size, self._limit(seqs), p.service_s)
        self._workers[worker_id] = w
        _refresh(w)
        self._push(w)
        return w

    def remove_worker(self, worker_id: str) -> None:
        """Stop tracking ``worker_id``; its tickets are dropped."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self.total_in_system -= w.in_system
            w.heap_version = -1

    def set_routable(self, worker_id: str, routable: bool) -> None:
        """Keep tracking load, but (un)list the worker for :meth:`least_loaded`."""
        w = self._workers.get(worker_id)
        if w is not None and w.routable != routable:
            w.routable = routable
            self._push(w)

    def set_cap(self, worker_id: str, cap: int) -> None:
        """Cap this router's in-flight requests to ``worker_id`` (0: no cap beyond the hard limit)."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.cap = max(0, cap)
            self._refresh(w)

    def get(self, worker_id: str) -> WorkerLoad | None:
        """The worker's load record, if tracked."""
        return self._workers.get(worker_id)

    def loads(self) -> Mapping[str, WorkerLoad]:
        """Every tracked worker's load record by id (the board's own mapping: read, don't write)."""
        return self._workers

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def heap_view(self) -> tuple[list[tuple[float, int, str]], dict[str, WorkerLoad]]:
        """(the least-backlog heap, the records by id): what the compiled candidate set reads and
        pops as :meth:`least_loaded` does (router/routing/_hotloop.c)."""
        return self._heap, self._workers

    def worker_ids(self) -> list[str]:
        """Every tracked worker id."""
        return list(self._workers)

    # -- reads -------------------------------------------------------------------------------
    def pending_s(self, worker_id: str, now: float) -> float:
        """Seconds of work ahead of a new request on ``worker_id`` (see the module docstring)."""
        return self._workers[worker_id].pending_s(now)

    def least_loaded(self, k: int, now: float, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Up to ``k`` routable workers under their hard limit with the least prefill backlog.

        Ordered by ``busy_until`` (the heap's key; on a tie, the worker updated longest ago), so
        a worker whose batch slots are all taken comes first if its prefill queue is empty: the
        slot wait in :meth:`WorkerLoad.pending_s` is not part of this order (module docstring).
        """
        hot = hotloop.hot
        if hot is not None:  # the loop below, compiled (router/routing/_hotloop.c): the same pops and pushes
            found = hot.least_loaded(self._heap, self._workers, k, skip)
            if found is not NotImplemented:
                return found
        out: list[str] = []
        popped: list[tuple[float, int, str]] = []
        heap = self._heap
        workers = self._workers
        while heap and len(out) < k:
            item = heapq.heappop(heap)
            w = workers.get(item[2])
            if w is None or w.heap_version != item[1] or not w.routable:
                continue  # stale entry: dropped for good
            popped.append(item)
            if item[2] not in skip and not w.over_limit_now:
                out.append(item[2])
        for item in popped:
            heapq.heappush(heap, item)
        return out

    # -- writes ------------------------------------------------------------------------------
    def apply_report(self, report: LoadReport, now: float) -> bool:
        """Take a worker's load report; returns False if it is stale or for an unknown worker."""
        w = self._workers.get(report.worker_id)
        if w is None:
            return False
        at = min(now, max(report.ts, now - self.max_report_age_s))
        if at < w.report_at:
            return False
        p = self.profile
        # Clamped to physical ranges (a report is input: protocol/messages.py bounds its types, and
        # these bounds keep one worker's claims from making it look free or bottomless).
        w.prefill_tokens_per_s = min(_clamp(report.prefill_tokens_per_s, MIN_PREFILL_TOKENS_PER_S,
                                            MAX_PREFILL_TOKENS_PER_S) or w.prefill_tokens_per_s or p.prefill_tokens_per_s,
                                     self._rate_cap(now))
        w.decode_step_s = _clamp(report.decode_step_s, MIN_DECODE_STEP_S, MAX_DECODE_STEP_S) or w.decode_step_s
        w.max_num_batched_tokens = report.max_num_batched_tokens or w.max_num_batched_tokens
        if report.max_num_seqs:
            w.max_num_seqs = min(report.max_num_seqs, MAX_NUM_SEQS)
            w.max_inflight = self._limit(w.max_num_seqs)
        w.block_size = report.block_size or w.block_size
        w.transfer_tokens_per_s = (_clamp(report.kv_tier_load_tokens_per_s, MIN_TRANSFER_TOKENS_PER_S,
                                          MAX_TRANSFER_TOKENS_PER_S) or w.transfer_tokens_per_s)
        w.capacity_tokens = report.capacity_tokens or w.capacity_tokens
        w.reported_running_tokens = report.running_tokens
        w.report_at = at
        w.reported_in_system = report.running + report.waiting
        w.reported_running = report.running
        unreported_tokens = 0
        sent_since = 0
        for t in w.tickets:
            if t.sent_at > at:
                sent_since += 1
                if not t.prefilled:
                    unreported_tokens += t.prefill_tokens
        # A report arrives late (heartbeat period, Redis polling): what it still counts as
        # queued or running may have prefilled or finished since its timestamp.
        done_since = prefilled_since = 0
        recent = w.recent
        while recent and recent[0][0] <= at:  # in time order; later reports are never older
            recent.popleft()
        for t, sent_at, tokens, finished in recent:
            if t > at and sent_at <= at:
                if finished:
                    done_since += 1
                else:
                    prefilled_since += tokens
        w.sent_since_report = sent_since
        w.finished_since_report = done_since
        self._recount(w)
        queued = max(0, report.queued_prefill_tokens - prefilled_since)
        w.busy_until = at + (queued + unreported_tokens) / w.rate_now  # = w.rate(), just refreshed
        self._push(w)
        return True

    def dispatch(self, worker_id: str, prefill_tokens: int, now: float) -> Ticket:
        """A request was sent to ``worker_id`` with ``prefill_tokens`` to compute."""
        w = self._workers[worker_id]
        t = Ticket(worker_id, now, prefill_tokens)
        w.tickets.add(t)
        w.sent_since_report += 1
        self._recount(w)
        t.work_s = work_s = prefill_tokens / w.rate_now  # = w.rate(), just refreshed
        busy = w.busy_until
        w.busy_until = t.eta = (now if now > busy else busy) + work_s  # max(busy, now)
        self._push(w)
        return t

    def prefilled(self, ticket: Ticket, now: float) -> None:
        """The request's first byte arrived: its prefill is no longer pending work.

        Only the part of its work the estimate still had ahead of ``now`` is taken off: the
        time already elapsed was spent on it (or on work queued before it).
        """
        if ticket.prefilled or ticket.finished:
            return
        ticket.prefilled = True
        ticket.prefilled_at = now
        w = self._workers.get(ticket.worker_id)
        if w is not None:
            w.recent.append((now, ticket.sent_at, ticket.prefill_tokens, False))
            remaining = max(0.0, min(ticket.work_s, ticket.eta - now))
            w.busy_until = max(now, w.busy_until - remaining)
            self._push(w)

    def finish(self, ticket: Ticket, now: float) -> None:
        """The request ended (completed, failed or cancelled)."""
        if ticket.finished:
            return
        if not ticket.prefilled:  # (usually it was, at its first byte)
            self.prefilled(ticket, now)
        ticket.finished = True
        w = self._workers.get(ticket.worker_id)
        if w is not None:
            # The time it held a slot: from the start of its prefill (first byte minus the
            # prefill's estimated time, or its sending if that was later) to now.
            start = ticket.sent_at
            if ticket.prefilled_at is not None:
                start = max(start, ticket.prefilled_at - ticket.work_s)
            w.service_s += self.service_alpha * (max(0.0, now - start) - w.service_s)
        if w is not None and ticket in w.tickets:
            w.tickets.discard(ticket)
            w.finished_since_report += 1
            w.recent.append((now, ticket.sent_at, 0, True))
            self._recount(w)
        elif w is not None:
            self._refresh(w)  # its service time changed

    # -- internals ---------------------------------------------------------------------------
    def _rate_cap(self, now: float) -> float:
        """The fastest prefill a worker may claim: ``RATE_CAP_FACTOR`` x the fleet's lower median
        (recomputed at most once a second). A heterogeneous fleet differs by a few times; a
        worker claiming far more is not believed beyond that."""
        if now - self._cap_rate_at >= 1.0 or now < self._cap_rate_at:
            rates = sorted(w.prefill_tokens_per_s for w in self._workers.values())
            self._cap_rate = RATE_CAP_FACTOR * rates[(len(rates) - 1) // 2] if len(rates) >= 2 else math.inf
            self._cap_rate_at = now
        return self._cap_rate

    def _limit(self, max_num_seqs: int) -> int:
        return self.max_inflight if self.max_inflight > 0 else 2 * max(1, max_num_seqs)

    def _recount(self, w: WorkerLoad) -> None:
        estimate = w.reported_in_system + w.sent_since_report - w.finished_since_report
        tickets = len(w.tickets)
        value = estimate if estimate > tickets else tickets
        self.total_in_system += value - w.in_system
        w.in_system = value
        _refresh(w)

    @staticmethod
    def _refresh(w: WorkerLoad) -> None:
        """Bring ``w``'s cached ``rate_now``, ``slot_wait_s`` and ``over_limit_now`` up to date (after any change)."""
        _refresh(w)

    def _push(self, w: WorkerLoad) -> None:
        """Put ``w`` on the least-loaded heap at its ``busy_until`` (older entries go stale)."""
        w.heap_version = version = next(self._counter)
        heap = self._heap
        heapq.heappush(heap, (w.busy_until, version, w.worker_id))
        if len(heap) > 4 * len(self._workers) + 64:
            self._compact()

    def _compact(self) -> None:
        workers = self._workers
        self._heap = [item for item in self._heap
                      if (w := workers.get(item[2])) is not None and w.heap_version == item[1]]
        heapq.heapify(self._heap)


# At the end: hotloop binds WorkerLoad (above) when it is imported, and this module calls it.
from router.routing import hotloop  # noqa: E402
