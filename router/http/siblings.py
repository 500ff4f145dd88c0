"""The other processes of one router (``prefixlb router --processes N``): one view, one admin API.

The N processes share ``--port`` (``SO_REUSEPORT``: the kernel hands each new connection to one
of them) and their routing state through Redis, as N routers would. What a client of the port
must not see split in N:

- ``GET /metrics``: the process that answers asks the others for theirs over their control
  sockets (a Unix socket each, in a directory only the router's user can open) and merges them
  (:func:`merge_metrics`): counters and histograms summed, the in-flight and queued gauges summed,
  every other gauge (a view of the shared state each process holds) labelled with its ``process``.
- ``GET /admin/usage``: the cost ledgers summed (:func:`sum_json`).
- A change through the admin API (POST, PUT, DELETE, but a pre-warm, which acts on the worker
  once): applied here, then replayed on every other process with the same token and body;
  ``X-Prefixlb-Processes-Applied: k/N`` says on how many it took.

Every answer names the process that gave it (``X-Prefixlb-Router-Process``).
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger("prefixlb.router")

HEADER_PROCESS = "X-Prefixlb-Router-Process"
HEADER_APPLIED = "X-Prefixlb-Processes-Applied"
SIBLING_TIMEOUT_S = 2.0
# Gauges that count this process's own requests: the router's total is their sum. Every other
# gauge describes state each process holds a copy of, and gets a ``process`` label.
SUMMED_GAUGES = frozenset({"prefixlb_router_inflight_requests", "prefixlb_router_queued_requests",
                           "prefixlb_router_worker_inflight_requests"})
SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
REPLAYED_HEADERS = ("Authorization", "Content-Type")


@dataclass(frozen=True, slots=True)
class ProcessSlot:
    """Which of a router's ``count`` processes this is, and where their control sockets live."""

    index: int
    count: int
    control_dir: str

    def socket(self, index: int) -> str:
        """The control socket of process ``index``."""
        return os.path.join(self.control_dir, f"process-{index}.sock")

    def ready_file(self, index: int) -> str:
        """Written by process ``index`` once it listens (the supervisor reads it)."""
        return os.path.join(self.control_dir, f"process-{index}.ready")

    def others(self) -> list[int]:
        """The other processes' indexes."""
        return [i for i in range(self.count) if i != self.index]


class Siblings:
    """HTTP over the other processes' control sockets (a session each, opened on first use)."""

    def __init__(self, slot: ProcessSlot) -> None:
        self.slot = slot
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def _session(self, index: int) -> aiohttp.ClientSession:
        session = self._sessions.get(index)
        if session is None or session.closed:
            session = self._sessions[index] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.slot.socket(index)),
                timeout=aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S))
        return session

    async def _call(self, index: int, method: str, path: str, headers: dict[str, str],
                    body: bytes) -> tuple[int, bytes] | None:
        try:
            async with self._session(index).request(method, "http://router" + path, headers=headers,
                                                    data=body or None) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("event=sibling_unreachable process=%d path=%s error=%r", index, path, str(exc)[:200])
            return None

    async def gather(self, method: str, path: str, headers: dict[str, str] | None = None,
                     body: bytes = b"") -> list[tuple[int, int, bytes]]:
        """The same request to every other process: (index, status, body) of those that answered."""
        others = self.slot.others()
        answers = await asyncio.gather(*(self._call(i, method, path, headers or {}, body) for i in others))
        return [(i, a[0], a[1]) for i, a in zip(others, answers) if a is not None]

    async def close(self) -> None:
        """Close the sessions (at shutdown)."""
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_metrics(texts: Iterable[tuple[int, str]], count: int) -> bytes:
    """One exposition text from the processes' own, given as (process index, text).

    Counters, histograms and the gauges in :data:`SUMMED_GAUGES` are summed sample by sample
    (``_created``: the earliest); every other gauge's samples get a ``process`` label. Two gauges
    say how many processes there are and how many answered this scrape.
    """
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    answered = 0
    for index, text in texts:
        answered += 1
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
                sums[family.name] = {}
            # A counter's ``_created`` is a gauge family of its own in this format: the earliest.
            summed = family.type in SUMMED_TYPES or family.name in SUMMED_GAUGES or family.name.endswith("_created")
            acc = sums[family.name]
            for sample in family.samples:
                if summed:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if sample.name.endswith("_created"):
                        acc[key] = min(acc.get(key, sample.value), sample.value)
                    else:
                        acc[key] = acc.get(key, 0.0) + sample.value
                else:
                    out.add_sample(sample.name, {**sample.labels, "process": str(index)}, sample.value)
    for name, acc in sums.items():
        for (sample_name, labels), value in acc.items():
            merged[name].add_sample(sample_name, dict(labels), value)
    processes = Metric("prefixlb_router_processes", "Processes this router runs (--processes)", "gauge")
    processes.add_sample("prefixlb_router_processes", {}, float(count))
    merged_count = Metric("prefixlb_router_processes_answering",
                          "Processes whose metrics this scrape merged (fewer than prefixlb_router_processes: "
                          "one was restarting or did not answer within 2 s)", "gauge")
    merged_count.add_sample("prefixlb_router_processes_answering", {}, float(answered))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), processes, merged_count]))
    return generate_latest(registry)


def sum_json(values: list[Any]) -> Any:
    """Numbers summed leaf by leaf over JSON objects of one shape (a key one lacks counts as
    absent); anything else is the first value's."""
    first = values[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values if isinstance(v, dict) for k in v)
        return {k: sum_json([v[k] for v in values if isinstance(v, dict) and k in v]) for k in keys}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        total = sum(numbers)
        return round(total, 9) if isinstance(total, float) else total
    return first
