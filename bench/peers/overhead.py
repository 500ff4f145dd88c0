"""The router's own cost beside the peers': ``python -m bench.router_overhead --peers``.

prefixlb, sglang-router and vllm-router (from ``.venv-peers``, ``bench/peers/install.sh``), and the
floor of a Python router (``bench/peers/floor.py``: a bare relay on uvloop), each in
front of the same simulated workers (``prefixlb worker --simulate --time-scale 1000``: the real
HTTP server, near-zero model time), all real processes on loopback, and the workers called
directly as the baseline. Each round measures every target, in an order rotated from round to
round, so that a neighbour's load on this shared machine falls on all of them alike:

1. **unloaded latency**: sequential non-streaming requests, one to each target in turn; the
   router's p50 / p90 minus direct's.
2. **streaming first chunk**: the same with ``"stream": true``, to the first SSE event.
3. **concurrency** (32): a closed loop of non-streaming requests through each target in turn; the
   router's CPU per completed request (user + system time of its whole process group, from
   ``/proc``) and requests per second.

Prompts cycle through ``PROMPTS`` distinct prefixes, so a cache-aware policy spreads them over the
workers; direct requests go to the workers round-robin.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import aiohttp

from bench.cluster import Cluster, build_extensions, cluster
from bench.peers.launch import DEFAULT_VENV, PEERS, ROOT
from bench.stats import percentile, rotated
from protocol.loopback import wait_http_ok

FLOOR = "python-floor"  # bench/peers/floor.py: what no Python router on uvloop can go below
ROUTERS = ("prefixlb", *PEERS, FLOOR)
PROMPTS = 16
TICKS = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds, so far, of every live process in process group ``pgid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def body_for(i: int, stream: bool) -> dict:
    """Request ``i``'s body: one of ``PROMPTS`` prefixes, a few output tokens."""
    return {"model": "llama-3-8b", "max_tokens": 4, "temperature": 0, "stream": stream,
            "prompt": f"Tenant {i % PROMPTS}: summarise the meeting notes below in one sentence. " * 2}


@dataclass
class Target:
    """Where requests go: a router (one URL, its process group) or the workers directly."""

    name: str
    urls: list[str]
    pgid: int | None = None
    sent: int = 0
    unloaded: list[float] = field(default_factory=list)
    first_chunk: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    req_per_s: list[float] = field(default_factory=list)

    def next_url(self) -> str:
        self.sent += 1
        return self.urls[self.sent % len(self.urls)]


async def one(http: aiohttp.ClientSession, target: Target, i: int, stream: bool) -> float:
    """Seconds to the whole answer (non-streaming) or to the first SSE event (streaming)."""
    return await timed_completion(http, target.next_url(), body_for(i, stream), stream, target.name)


async def timed_completion(http: aiohttp.ClientSession, url: str, body: dict, stream: bool, name: str) -> float:
    """POST ``body`` to ``url``/v1/completions: seconds to the whole answer, or to the first SSE
    event when ``stream`` (a non-200 answer raises, naming ``name``)."""
    t0 = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{name}: HTTP {resp.status}: {await resp.text()}")
        if stream:
            await resp.content.readuntil(b"\n\n")
            first = time.perf_counter() - t0
            await resp.read()
            return first
        await resp.read()
        return time.perf_counter() - t0


async def sequential(targets: Sequence[Target], n: int, stream: bool, warmup: int = 0) -> None:
    """``n`` requests to each target, interleaved request by request; latencies appended."""
    async with aiohttp.ClientSession() as http:
        for i in range(warmup + n):
            for t in targets:
                seconds = await one(http, t, i, stream)
                if i >= warmup:
                    (t.first_chunk if stream else t.unloaded).append(seconds)


async def _closed_loop(target: Target, n: int, concurrency: int, warmup: int,
                       request: Callable[[aiohttp.ClientSession, int], Awaitable[float]]) -> tuple[float, float, float]:
    """``warmup`` calls of ``request(http, i)`` (the connection pools fill), then ``n`` more, by
    ``concurrency`` clients: the router's CPU seconds (0 without a process group), the wall
    seconds and the sum of what the ``n`` calls returned."""
    remaining = warmup
    total = 0.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def client() -> None:
            nonlocal remaining, total
            while remaining > 0:
                remaining -= 1
                got = await request(http, remaining)
                total += got  # (not ``total += await ...``: that reads ``total`` before the wait)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        remaining, total = n, 0.0
        cpu0 = group_cpu_seconds(target.pgid) if target.pgid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        cpu = group_cpu_seconds(target.pgid) - cpu0 if target.pgid else 0.0
    return cpu, elapsed, total


async def closed_loop(target: Target, n: int, concurrency: int) -> None:
    """``n`` non-streaming requests by ``concurrency`` clients; CPU per request and req/s appended."""
    cpu, elapsed, _ = await _closed_loop(target, n, concurrency, min(n, 4 * concurrency),
                                         lambda http, i: one(http, target, i, False))
    if target.pgid:
        target.cpu_us.append(1e6 * cpu / n)
    target.req_per_s.append(n / elapsed)


def start(c: Cluster, routers: Sequence[str], workers: int, policy: str, venv: Path,
          baseline: Path | None = None, time_scale: float = 1000,
          pythons: Sequence[tuple[str, str]] = ()) -> list[Target]:
    """The workers, then each router in front of them; [direct, *routers] as targets
    (``baseline``: a checkout of prefixlb whose router runs too, as ``prefixlb@baseline``;
    ``pythons``: (name, executable) of other interpreters that each run this checkout's router
    too, as ``prefixlb@name``, their compiled loops built in place first, and the python-floor,
    as ``python-floor@name``, where those two are among ``routers``)."""
    # (target name, the interpreter of a Python router on another one than this)
    entries: list[tuple[str, str | None]] = [(name, None) for name in routers]
    if baseline:
        entries.append(("prefixlb@baseline", None))
    entries += [(f"{kind}@{tag}", exe) for tag, exe in pythons for kind in ("prefixlb", FLOOR) if kind in routers]
    for exe in dict.fromkeys(exe for _, exe in entries if exe):
        build_extensions(exe)
    fleet = c.workers(workers, time_scale=time_scale)
    targets = [Target("direct", [w.url for w in fleet])]
    for name, python in entries:
        kind = name.partition("@")[0]
        if kind == FLOOR:
            proc = c.floor(fleet, python=python, name=name.replace("@", "-"))
        elif kind == "prefixlb":
            if name == "prefixlb@baseline":
                proc = c.router(fleet, policy, source=baseline)
            elif python:  # this checkout, on another interpreter (which has no prefixlb installed)
                proc = c.router(fleet, policy, source=ROOT, python=python, name=f"router-{name.replace('@', '-')}")
            else:
                proc = c.router(fleet, policy)
            wait_http_ok(proc.url + "/health", 30, accept=lambda b: json.loads(b)["routable_workers"] == workers)
        else:
            proc = c.peer(name, policy, fleet, venv=venv)
        targets.append(Target(name, [proc.url], pgid=proc.popen.pid))
    return targets


def measure(routers: Sequence[str] = ROUTERS, workers: int = 4, rounds: int = 3, n_seq: int = 150,
            n_load: int = 3000, concurrency: int = 32, policy: str = "cache_aware",
            venv: Path = DEFAULT_VENV, baseline: Path | None = None,
            pythons: Sequence[tuple[str, str]] = ()) -> dict:
    """Run the rounds; per target: latencies, added latency, CPU per request, req/s."""
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as logs, cluster(logs) as c:
        targets = start(c, routers, workers, policy, venv, baseline, pythons=pythons)
        for r in range(rounds):
            order = rotated(targets, r)
            asyncio.run(sequential(order, n_seq, stream=False, warmup=10 if r == 0 else 0))
            asyncio.run(sequential(order, n_seq, stream=True, warmup=10 if r == 0 else 0))
            for t in order:
                asyncio.run(closed_loop(t, n_load, concurrency))
    return summarize(targets, concurrency, rounds)


STREAM_TIME_SCALE = 20  # the streaming fleet: a decode step of ~1.5 ms, so a stream's events arrive one by one


async def streamed(http: aiohttp.ClientSession, url: str, i: int, tokens: int) -> int:
    """One streaming completion of ``tokens`` tokens read to its end; the SSE data events it held."""
    body = {**body_for(i, True), "max_tokens": tokens, "ignore_eos": True}
    events = 0
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                events += 1
    return events


async def stream_loop(target: Target, n: int, concurrency: int, tokens: int) -> tuple[float, float, float]:
    """``n`` streaming requests of ``tokens`` tokens by ``concurrency`` clients: (router CPU µs per
    request, per SSE event; SSE events per request)."""
    cpu, _, events = await _closed_loop(target, n, concurrency, concurrency,
                                        lambda http, i: streamed(http, target.next_url(), i, tokens))
    return 1e6 * cpu / n, 1e6 * cpu / max(1.0, events), events / n


def measure_streaming(routers: Sequence[str] = ROUTERS, workers: int = 4, rounds: int = 3, n: int = 300,
                      concurrency: int = 16, tokens: int = 64, policy: str = "cache_aware",
                      venv: Path = DEFAULT_VENV, baseline: Path | None = None,
                      pythons: Sequence[tuple[str, str]] = ()) -> dict:
    """Router CPU per streamed request and per SSE event (medians over rounds), in front of a fleet
    whose streams send an event every ~1.5 ms (``STREAM_TIME_SCALE``), as a GPU's every ~30 ms."""
    with tempfile.TemporaryDirectory(prefix="router-streaming-") as logs, cluster(logs) as c:
        targets = start(c, routers, workers, policy, venv, baseline, time_scale=STREAM_TIME_SCALE,
                        pythons=pythons)[1:]
        per_request: dict[str, list[float]] = {t.name: [] for t in targets}
        per_event: dict[str, list[float]] = {t.name: [] for t in targets}
        events: dict[str, list[float]] = {t.name: [] for t in targets}
        for r in range(rounds):
            for t in rotated(targets, r):
                req_us, event_us, count = asyncio.run(stream_loop(t, n, concurrency, tokens))
                per_request[t.name].append(req_us)
                per_event[t.name].append(event_us)
                events[t.name].append(count)
    return {"concurrency": concurrency, "tokens": tokens, "rounds": rounds,
            "targets": {name: {"cpu_us_per_request": statistics.median(per_request[name]),
                               "cpu_us_per_event": statistics.median(per_event[name]),
                               "cpu_us_per_event_rounds": per_event[name],
                               "events_per_request": statistics.median(events[name])} for name in per_request}}


def report_streaming(result: dict) -> str:
    """A markdown table of :func:`measure_streaming`'s result."""
    rows = result["targets"]
    lines = [f"# streaming: router CPU per request of {result['tokens']} tokens and per SSE event "
             f"(concurrency {result['concurrency']}, {result['rounds']} rounds)",
             "| target | CPU µs/request | CPU µs/event | events/request |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['cpu_us_per_request']:.0f} | {r['cpu_us_per_event']:.1f} "
              f"| {r['events_per_request']:.0f} |" for name, r in rows.items()]
    if "prefixlb" in rows and "sglang-router" in rows:
        lines.append(f"prefixlb / sglang-router: CPU per event "
                     f"{rows['prefixlb']['cpu_us_per_event'] / rows['sglang-router']['cpu_us_per_event']:.2f}x")
    return "\n".join(lines)


def summarize(targets: Sequence[Target], concurrency: int, rounds: int) -> dict:
    """Per target: p50 / p90 (ms), added over direct, CPU µs per request and req/s (medians over rounds)."""
    direct = targets[0]
    ms = 1000.0
    out: dict = {"concurrency": concurrency, "rounds": rounds, "targets": {}}
    for t in targets:
        row = {"unloaded_p50_ms": percentile(t.unloaded, 50) * ms, "unloaded_p90_ms": percentile(t.unloaded, 90) * ms,
               "first_chunk_p50_ms": percentile(t.first_chunk, 50) * ms,
               "first_chunk_p90_ms": percentile(t.first_chunk, 90) * ms,
               "req_per_s": statistics.median(t.req_per_s), "req_per_s_rounds": t.req_per_s}
        if t is not direct:
            row.update(
                added_p50_ms=row["unloaded_p50_ms"] - out["targets"]["direct"]["unloaded_p50_ms"],
                added_p90_ms=row["unloaded_p90_ms"] - out["targets"]["direct"]["unloaded_p90_ms"],
                first_chunk_added_p50_ms=row["first_chunk_p50_ms"] - out["targets"]["direct"]["first_chunk_p50_ms"],
                first_chunk_vs_direct=row["first_chunk_p50_ms"] / out["targets"]["direct"]["first_chunk_p50_ms"],
                cpu_us_per_request=statistics.median(t.cpu_us), cpu_us_rounds=t.cpu_us)
        out["targets"][t.name] = row
    return out


def report(result: dict) -> str:
    """A markdown table of :func:`measure`'s result, and each router's ratios to sglang-router's."""
    rows = result["targets"]
    lines = [f"# router overhead beside the peers (concurrency {result['concurrency']}, {result['rounds']} rounds, "
             f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores shared by everything)",
             "| target | CPU µs/request | req/s | unloaded p50 ms (added) | p90 added | first chunk p50 ms "
             "(added, ÷ direct) |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name == "direct":
            lines.append(f"| direct | - | {r['req_per_s']:.0f} | {r['unloaded_p50_ms']:.2f} | - | "
                         f"{r['first_chunk_p50_ms']:.2f} |")
            continue
        lines.append(f"| {name} | {r['cpu_us_per_request']:.0f} | {r['req_per_s']:.0f} | {r['unloaded_p50_ms']:.2f} "
                     f"({r['added_p50_ms']:+.2f}) | {r['added_p90_ms']:+.2f} | {r['first_chunk_p50_ms']:.2f} "
                     f"({r['first_chunk_added_p50_ms']:+.2f}, {r['first_chunk_vs_direct']:.2f}x) |")
    ours = [name for name in rows if name == "prefixlb" or (name.startswith("prefixlb@") and name != "prefixlb@baseline")]
    pairs = [(name, "sglang-router") for name in ours] + [("prefixlb", "prefixlb@baseline")]
    for mine, other in pairs:
        if mine in rows and other in rows:
            p, s = rows[mine], rows[other]
            lines.append(f"{mine} / {other}: CPU per request {p['cpu_us_per_request'] / s['cpu_us_per_request']:.2f}x, "
                         f"added p50 {p['added_p50_ms']:.2f} vs {s['added_p50_ms']:.2f} ms, "
                         f"req/s {p['req_per_s'] / s['req_per_s']:.2f}x")
    for mine in ours:
        floor = FLOOR + mine[len("prefixlb"):]  # the floor on the same interpreter
        if floor in rows:
            p, f = rows[mine], rows[floor]
            lines.append(f"{mine} over {floor} (its own work, beyond the event loop and sockets): CPU per request "
                         f"+{p['cpu_us_per_request'] - f['cpu_us_per_request']:.0f} µs, added p50 "
                         f"+{p['added_p50_ms'] - f['added_p50_ms']:.2f} ms")
    return "\n".join(lines)
