"""Throughput of one router with 1 and N processes (``prefixlb router --processes N``).

    python -m bench.router_processes                      # 1 and 2 processes, 3 rounds each
    python -m bench.router_processes --processes 1 2 4 --rounds 2 --seconds 8

Four mock OpenAI workers (one process serving four ports, answering a fixed completion: the
worker costs next to nothing, so the router is what is measured), Redis with a key prefix of
the run's own, and a closed-loop client (``--concurrency`` requests in flight over as many
keep-alive connections, so ``SO_REUSEPORT`` spreads them over the processes). Rounds alternate
between the settings (1, 2, 1, 2, ...) so that a change in the machine's load hits each alike.
Per setting: req/s, latency p50 / p99, and the router's CPU per request (utime + stime of every
router process, from ``/proc``).

Goal (issue 18): N processes >= 0.85 N x the req/s of one at the same p99, up to the cores the
router gets. The client and the workers run on the same machine: on a machine with fewer cores
than processes + client + workers need, the ratio is bounded by the machine, not the router;
the CPU per request and the load average are printed to tell which.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

import aiohttp
from aiohttp import web

from bench.stats import percentile
from protocol.loopback import free_port, wait_http_ok

TICKS = os.sysconf("SC_CLK_TCK")
MODEL = "llama-3-8b"
ANSWER = json.dumps({"id": "cmpl-mock", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "text": " a fixed answer", "finish_reason": "length", "logprobs": None}],
                     "usage": {"prompt_tokens": 520, "completion_tokens": 4, "total_tokens": 524,
                               "prompt_tokens_details": {"cached_tokens": 512}}}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                 "owned_by": "mock"}]}).encode()
GROUPS = [f"System prompt of tenant {g}: you answer questions about invoices. " * 30 for g in range(8)]


def serve_mock_workers(ports: list[int]) -> None:
    """Fixed-answer OpenAI servers on ``ports`` (one process), until killed."""
    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=MODELS, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> None:
        for port in ports:
            app = web.Application()
            app.router.add_post("/v1/completions", completion)
            app.router.add_get("/v1/models", models)
            app.router.add_get("/health", health)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its children alive now, plus what its reaped children used."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


@contextmanager
def router(processes: int, worker_ports: list[int], redis: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    args = [sys.executable, "-m", "prefixlb", "router", "--port", str(port), "--processes", str(processes),
            "--redis", redis, "--redis-prefix", f"bench-processes-{uuid.uuid4().hex[:8]}:",
            "--log-level", "warning", "--health-interval", "1"]
    for p in worker_ports:
        args += ["--worker", f"openai=http://127.0.0.1:{p}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(url + "/ready", 120, alive=lambda: proc.poll() is None):
            raise RuntimeError(f"router did not become ready: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def closed_loop(url: str, concurrency: int, seconds: float) -> tuple[int, list[float], int]:
    """(completed, latencies, failed) of ``concurrency`` clients for ``seconds``."""
    latencies: list[float] = []
    failed = 0
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as http:
        end = time.perf_counter() + seconds

        async def client(k: int) -> None:
            nonlocal failed
            i = 0
            while time.perf_counter() < end:
                body = {"model": MODEL, "prompt": GROUPS[(k + i) % len(GROUPS)] + f"question {k}-{i}",
                        "max_tokens": 8}
                t0 = time.perf_counter()
                try:
                    async with http.post(url + "/v1/completions", json=body) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    failed += 1
                i += 1

        await asyncio.gather(*(client(k) for k in range(concurrency)))
    return len(latencies), latencies, failed


def measure(processes: int, ports: list[int], redis: str, concurrency: int, seconds: float) -> dict:
    with router(processes, ports, redis) as (url, pid):
        asyncio.run(closed_loop(url, concurrency, 1.0))  # warm: connections, the index, the workers' loads
        cpu0, t0 = tree_cpu_seconds(pid), time.perf_counter()
        done, latencies, failed = asyncio.run(closed_loop(url, concurrency, seconds))
        wall, cpu = time.perf_counter() - t0, tree_cpu_seconds(pid) - cpu0
    latencies.sort()
    return {"processes": processes, "req_per_s": done / wall, "p50_ms": 1e3 * percentile(latencies, 50),
            "p99_ms": 1e3 * percentile(latencies, 99), "router_cpu_us_per_request": 1e6 * cpu / max(done, 1),
            "router_cores": cpu / wall, "failed": failed, "requests": done}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--json", help="write the rounds here")
    ap.add_argument("--serve-mock", type=int, nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_mock:
        serve_mock_workers(args.serve_mock)
        return 0
    ports = [free_port() for _ in range(4)]
    mock = subprocess.Popen([sys.executable, "-m", "bench.router_processes", "--serve-mock", *map(str, ports)])
    rounds: list[dict] = []
    try:
        for p in ports:
            if not wait_http_ok(f"http://127.0.0.1:{p}/health", 30, alive=lambda: mock.poll() is None):
                raise RuntimeError("the mock workers did not start")
        for r in range(args.rounds):
            for n in args.processes:
                row = measure(n, ports, args.redis, args.concurrency, args.seconds)
                row["round"] = r
                rounds.append(row)
                print(f"round {r} processes {n}: {row['req_per_s']:,.0f} req/s  p50 {row['p50_ms']:.1f} ms  "
                      f"p99 {row['p99_ms']:.1f} ms  router {row['router_cpu_us_per_request']:.0f} us/req "
                      f"({row['router_cores']:.2f} cores)  failed {row['failed']}", flush=True)
    finally:
        mock.terminate()
        mock.wait()
    print(f"\nload average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores; median over {args.rounds} rounds:")
    base = None
    print("| processes | req/s | p50 ms | p99 ms | router CPU µs/req | router cores | req/s ÷ 1 process |")
    print("|---|---|---|---|---|---|---|")
    for n in args.processes:
        rows = [r for r in rounds if r["processes"] == n]

        def med(key: str) -> float:
            values = sorted(r[key] for r in rows)
            return values[len(values) // 2]
        rps = med("req_per_s")
        base = base or rps
        print(f"| {n} | {rps:,.0f} | {med('p50_ms'):.1f} | {med('p99_ms'):.1f} | "
              f"{med('router_cpu_us_per_request'):.0f} | {med('router_cores'):.2f} | {rps / base:.2f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rounds, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
