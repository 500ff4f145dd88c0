"""What the router adds on top of calling a worker directly.

    python -m bench.router_overhead                # about a minute
    python -m bench.router_overhead --quick
    python -m bench.router_overhead --peers        # beside sglang-router and vllm-router, 4 workers
    python -m bench.router_overhead --peers --streaming   # CPU per streamed request and SSE event
    python -m bench.router_overhead --peers --python pgo=/tmp/rdeb/bin/python   # and on another CPython

``--peers`` is ``bench/peers/overhead.py``: prefixlb, sglang-router 0.3.2, vllm-router 0.1.17 and the
floor of a Python router (``bench/peers/floor.py``) in front of the same simulated workers,
interleaved rounds (``--python NAME=EXECUTABLE``: this checkout's router and the floor on another
interpreter too, as ``prefixlb@NAME`` and ``python-floor@NAME``); what follows is the default mode.

One simulated worker (``prefixlb worker --simulate --time-scale 1000``: the same HTTP server,
near-zero model time, so the HTTP and routing costs dominate) and one router in front of it
(``prefixlb router --worker ...``), both real processes on loopback. Every measurement of the
router is paired with the same measurement against the worker directly, in the same run,
interleaved, so the difference is the router's share:

1. **unloaded latency**: sequential non-streaming requests; p50 / p90 of router - direct.
   Target: <= 0.3 ms added at p50.
2. **streaming time to first chunk**: sequential streaming requests, time to the first SSE
   event; p50 / p90 of router - direct. Target: <= 1 ms added.
3. **concurrency 32**: 32 clients in a closed loop through the router; the router process's CPU
   time (``/proc/<pid>/stat`` utime + stime) per request, and the worker's as the in-run
   baseline. Target: <= 150 µs of router CPU per request.

The same three are measured for a bare aiohttp proxy (no validation, no routing, no metrics:
``serve_bare_proxy``) in the same run: the floor any router built on aiohttp starts from.

The client, router and worker share the machine's cores: numbers measured on a busy machine are
upper bounds (the load average is printed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import contextlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import aiohttp
from aiohttp import web

from bench.cluster import interpreter
from bench.peers.launch import DEFAULT_VENV
from bench.peers.overhead import ROUTERS
from bench.peers.overhead import measure as peers_overhead
from bench.peers.overhead import measure_streaming as peers_streaming
from bench.peers.overhead import report_streaming as peers_streaming_report
from bench.peers.overhead import report as peers_report
from bench.peers.overhead import timed_completion
from bench.stats import percentile
from protocol.loopback import free_port, wait_http_ok

TICKS = os.sysconf("SC_CLK_TCK")
SESSION = web.AppKey("session", aiohttp.ClientSession)
BODY = {"model": "llama-3-8b", "prompt": "Summarise the meeting notes below in one sentence. " * 2,
        "max_tokens": 4, "temperature": 0}


def serve_bare_proxy(port: int, upstream: str) -> None:
    """A minimal aiohttp proxy (no validation, no routing): the floor of any aiohttp router."""
    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app[SESSION].post(upstream + request.path, data=body,
                                             headers={"Content-Type": "application/json"}) as up:
            if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                out = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
            return web.Response(body=await up.read(), status=up.status,
                                headers={"Content-Type": up.headers.get("Content-Type", "application/json")})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def session(app: web.Application):
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    if os.environ.get("PREFIXLB_EVENT_LOOP", "auto") != "asyncio":  # the loop `prefixlb router` runs on
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(session)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, handler_cancellation=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _routable(body: bytes) -> bool:
    """A router's /health body once it has a worker to route to (a worker's or the bare proxy's: any)."""
    return json.loads(body).get("routable_workers", 1) >= 1


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    if not wait_http_ok(url + "/health", timeout, alive=lambda: proc.poll() is None, accept=_routable):
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        raise RuntimeError(f"{url} not healthy after {timeout} s")


@contextmanager
def cluster() -> Iterator[tuple[str, str, int, int, str, int]]:
    """(worker URL, router URL, worker pid, router pid, bare proxy URL, bare proxy pid)."""
    wport, rport, bport = free_port(), free_port(), free_port()
    procs = []
    try:
        worker = subprocess.Popen([sys.executable, "-m", "prefixlb", "worker", "--simulate", "--time-scale", "1000",
                                   "--port", str(wport), "--worker-id", "bench-w", "--log-level", "warning"])
        procs.append(worker)
        wurl = f"http://127.0.0.1:{wport}"
        _wait_healthy(wurl, worker)
        router = subprocess.Popen([sys.executable, "-m", "prefixlb", "router", "--port", str(rport), "--worker", wurl,
                                   "--log-level", "warning"])
        procs.append(router)
        rurl = f"http://127.0.0.1:{rport}"
        _wait_healthy(rurl, router)
        bare = subprocess.Popen([sys.executable, "-m", "bench.router_overhead", "--serve-bare-proxy", str(bport),
                                 wurl])
        procs.append(bare)
        burl = f"http://127.0.0.1:{bport}"
        _wait_healthy(burl, bare)
        yield wurl, rurl, worker.pid, router.pid, burl, bare.pid
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


async def _one(http: aiohttp.ClientSession, url: str, stream: bool) -> float:
    """Seconds to the full answer (non-streaming) or to the first SSE event (streaming)."""
    return await timed_completion(http, url, {**BODY, "stream": stream}, stream, url)


async def paired(wurl: str, rurl: str, n: int, stream: bool) -> dict:
    """Interleaved direct / router requests: latency percentiles and the router's addition."""
    direct, routed = [], []
    async with aiohttp.ClientSession() as http:
        for _ in range(20):
            await _one(http, wurl, stream)
            await _one(http, rurl, stream)
        for _ in range(n):
            direct.append(await _one(http, wurl, stream))
            routed.append(await _one(http, rurl, stream))
    ms = 1000.0
    return {"direct_p50_ms": percentile(direct, 50) * ms, "router_p50_ms": percentile(routed, 50) * ms,
            "added_p50_ms": (percentile(routed, 50) - percentile(direct, 50)) * ms,
            "added_p90_ms": (percentile(routed, 90) - percentile(direct, 90)) * ms}


async def concurrent(url: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    """``n`` requests by ``concurrency`` closed-loop clients: (wall seconds, latencies)."""
    latencies: list[float] = []
    remaining = n
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        async def client() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                latencies.append(await _one(http, url, False))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies


async def loaded(wurl: str, rurl: str, wpid: int, rpid: int, n: int, concurrency: int) -> dict:
    """Router and worker CPU per request at ``concurrency``, and latencies direct vs routed."""
    await concurrent(rurl, 100, concurrency)  # warm-up
    direct_s, direct_lat = await concurrent(wurl, n, concurrency)
    r0, w0 = cpu_seconds(rpid), cpu_seconds(wpid)
    routed_s, routed_lat = await concurrent(rurl, n, concurrency)
    r1, w1 = cpu_seconds(rpid), cpu_seconds(wpid)
    return {"concurrency": concurrency, "requests": n,
            "router_cpu_us_per_request": 1e6 * (r1 - r0) / n, "worker_cpu_us_per_request": 1e6 * (w1 - w0) / n,
            "direct_req_per_s": n / direct_s, "router_req_per_s": n / routed_s,
            "direct_p50_ms": percentile(direct_lat, 50) * 1000, "router_p50_ms": percentile(routed_lat, 50) * 1000}


def main(argv: list[str] | None = None) -> int:
    """Run the three measurements for the router and for a bare aiohttp proxy; print them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="the servers' event loop (PREFIXLB_EVENT_LOOP; auto: uvloop when installed)")
    parser.add_argument("--peers", action="store_true",
                        help="prefixlb beside sglang-router and vllm-router in front of --workers simulated workers")
    parser.add_argument("--routers", default=",".join(ROUTERS), help="--peers: which routers (comma-separated)")
    parser.add_argument("--workers", type=int, default=4, help="--peers: simulated workers")
    parser.add_argument("--rounds", type=int, default=3, help="--peers: interleaved rounds")
    parser.add_argument("--requests", type=int, default=None,
                        help="--peers: sequential requests per target and round (closed loop: 20x)")
    parser.add_argument("--policy", default="cache_aware", help="--peers: every router's policy")
    parser.add_argument("--streaming", action="store_true",
                        help="--peers: instead, router CPU per streamed request (64 tokens) and per SSE event, "
                             "in front of workers that send an event every ~1.5 ms (at most 16 streams at once)")
    parser.add_argument("--peers-venv", type=Path, default=DEFAULT_VENV, help="--peers: where install.sh put them")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="--peers: another checkout of prefixlb (e.g. `git archive <commit> | tar -x -C /tmp/base`) "
                             "whose router runs too, as prefixlb@baseline: before / after in one run")
    parser.add_argument("--python", type=interpreter, action="append", default=[], metavar="NAME=EXECUTABLE",
                        help="--peers: also run this checkout's router (and the python-floor) on another interpreter "
                             "(with the router's dependencies), as prefixlb@NAME: e.g. a PGO+LTO build, as the router "
                             "image's (repeatable)")
    parser.add_argument("--serve-bare-proxy", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_bare_proxy:
        serve_bare_proxy(int(args.serve_bare_proxy[0]), args.serve_bare_proxy[1])
        return 0
    os.environ["PREFIXLB_EVENT_LOOP"] = args.event_loop  # inherited by worker, router and bare proxy
    if args.peers:
        return _peers(args)
    n_seq = 100 if args.quick else 400
    n_load = 600 if args.quick else 3000
    results = {}
    with cluster() as (wurl, rurl, wpid, rpid, burl, bpid):
        for name, url, pid in (("router", rurl, rpid), ("bare aiohttp proxy", burl, bpid)):
            results[name] = {"unloaded": asyncio.run(paired(wurl, url, n_seq, stream=False)),
                             "streaming": asyncio.run(paired(wurl, url, n_seq, stream=True)),
                             "concurrency": asyncio.run(loaded(wurl, url, wpid, pid, n_load, args.concurrency))}
    print(f"# router overhead  (servers' event loop: {args.event_loop}; load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores shared by client, proxy and worker)")
    for name, r in results.items():
        unloaded, streaming, busy = r["unloaded"], r["streaming"], r["concurrency"]
        print(f"{name}:")
        print(f"  unloaded, non-streaming: direct p50 {unloaded['direct_p50_ms']:.2f} ms, via {name} "
              f"{unloaded['router_p50_ms']:.2f} ms: added p50 {unloaded['added_p50_ms']:.2f} ms "
              f"(target <= 0.3), p90 {unloaded['added_p90_ms']:.2f} ms")
        print(f"  streaming, first chunk:  direct p50 {streaming['direct_p50_ms']:.2f} ms, via {name} "
              f"{streaming['router_p50_ms']:.2f} ms: added p50 {streaming['added_p50_ms']:.2f} ms "
              f"(target <= 1), p90 {streaming['added_p90_ms']:.2f} ms")
        print(f"  concurrency {busy['concurrency']}: {name} CPU {busy['router_cpu_us_per_request']:.0f} µs/request "
              f"(target <= 150), worker CPU {busy['worker_cpu_us_per_request']:.0f} µs/request (ratio "
              f"{busy['router_cpu_us_per_request'] / busy['worker_cpu_us_per_request']:.2f}); "
              f"{busy['direct_req_per_s']:.0f} req/s direct, {busy['router_req_per_s']:.0f} req/s via {name}")
    router, bare = results["router"], results["bare aiohttp proxy"]
    print(f"router / bare proxy: added latency {router['unloaded']['added_p50_ms'] / bare['unloaded']['added_p50_ms']:.2f}x, "
          f"CPU per request {router['concurrency']['router_cpu_us_per_request'] / bare['concurrency']['router_cpu_us_per_request']:.2f}x")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def _peers(args: argparse.Namespace) -> int:
    routers = [r for r in args.routers.split(",") if r]
    unknown = set(routers) - set(ROUTERS)
    if unknown:
        raise SystemExit(f"--routers: unknown {', '.join(sorted(unknown))} (known: {', '.join(ROUTERS)})")
    if any(name == "baseline" for name, _ in args.python):
        raise SystemExit("--python: the name 'baseline' is --baseline's (prefixlb@baseline)")
    n_seq = args.requests or (50 if args.quick else 150)
    if args.streaming:
        streamed = peers_streaming(routers, workers=args.workers, rounds=args.rounds, n=2 * n_seq,
                                   concurrency=min(16, args.concurrency), policy=args.policy,
                                   venv=args.peers_venv, baseline=args.baseline, pythons=args.python)
        print(peers_streaming_report(streamed))
        if args.json:
            print(json.dumps(streamed, indent=2))
        return 0
    result = peers_overhead(routers, workers=args.workers, rounds=args.rounds, n_seq=n_seq, n_load=20 * n_seq,
                            concurrency=args.concurrency, policy=args.policy, venv=args.peers_venv,
                            baseline=args.baseline, pythons=args.python)
    print(peers_report(result))
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
