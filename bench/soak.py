"""Soak: steady load of distinct prompts for a long time; router memory and Redis memory must stay flat.

Every request has a prompt nobody sent before, so every request adds prefix-index entries to the
routers, KV events to the Redis stream and index snapshots to Redis: the worst case for memory.
What keeps it flat are the bounds (``--index-max-entries`` LRU on the router, ``MAXLEN`` on the
stream, one overwritten snapshot key, expiring registry keys). This benchmark measures that they
hold: it samples the router's RSS, its index size, and Redis's ``used_memory`` and stream length
every ``--sample-interval`` seconds, and compares the second half of the run with its middle.

    python -m bench.soak --duration 600 --out runs/soak

Everything runs locally: a private ``redis-server`` on a free port (never the shared one),
simulated workers registering themselves in it, and one router (``bench/cluster.py``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.cluster import Process, RedisServer, cluster
from protocol.loopback import free_port


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric_value(text: str, name: str) -> float:
    """One unlabelled sample from Prometheus exposition text (0 when absent)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@dataclass(slots=True)
class Sample:
    """One look at the system under load."""

    t_s: float
    requests: int
    errors: int
    router_rss_mb: float
    index_entries: int
    redis_used_mb: float
    stream_length: int
    redis_keys: int


async def drive(url: str, model: str, concurrency: int, prompt_chars: int, max_tokens: int, deadline: float,
                counters: dict[str, int]) -> None:
    """Closed-loop clients, each request a prompt never sent before (non-streaming, short answers)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def client(i: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                # Distinct from the first bytes on: every chunk of every prompt is new.
                unique = f"client {i} request {n} " + os.urandom(prompt_chars // 2).hex()
                body = {"model": model, "prompt": unique[:prompt_chars], "max_tokens": max_tokens,
                        "ignore_eos": True}
                try:
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    ok = False
                counters["requests"] += 1
                if not ok:
                    counters["errors"] += 1

        await asyncio.gather(*(client(i) for i in range(concurrency)))


async def sample_loop(router: Process, redis_port: int, start: float, deadline: float, interval: float,
                      counters: dict[str, int], samples: list[Sample], verbose: bool) -> None:
    """Sample every ``interval`` seconds until ``deadline``."""
    import redis.asyncio as aioredis

    client = aioredis.Redis(port=redis_port)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while True:
            async with http.get(router.url + "/metrics") as resp:
                text = await resp.text()
            info = await client.info("memory")
            keys = await client.dbsize()
            stream = 0
            async for key in client.scan_iter(match="*kv_events"):
                stream += await client.xlen(key)
            s = Sample(round(time.monotonic() - start, 1), counters["requests"], counters["errors"],
                       round(rss_bytes(router.popen.pid) / 2**20, 1),
                       int(metric_value(text, "prefixlb_router_index_entries")),
                       round(info["used_memory"] / 2**20, 1), stream, keys)
            samples.append(s)
            if verbose:
                print(json.dumps(asdict(s)), flush=True)
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    await client.aclose()


def summarise(samples: list[Sample], duration_s: float) -> dict:
    """Memory at the middle of the run vs at its end: flat means the second half added ~nothing."""
    half = [s for s in samples if s.t_s >= duration_s / 2]
    mid, end = half[0], samples[-1]

    def slope_per_min(values: list[float], times: list[float]) -> float:
        if len(values) < 2:
            return 0.0
        return statistics.linear_regression(times, values).slope * 60.0

    times = [s.t_s for s in half]
    span_min = max(1e-9, (end.t_s - mid.t_s) / 60.0)
    return {
        "requests": end.requests, "errors": end.errors,
        "req_per_s": round(end.requests / max(1e-9, end.t_s), 1),
        "router_rss_mb": {"first": samples[0].router_rss_mb, "mid": mid.router_rss_mb, "end": end.router_rss_mb,
                          "max": max(s.router_rss_mb for s in samples),
                          "second_half_slope_mb_per_min": round(slope_per_min([s.router_rss_mb for s in half], times), 3),
                          "end_over_mid": round(end.router_rss_mb / mid.router_rss_mb, 3)},
        "redis_used_mb": {"first": samples[0].redis_used_mb, "mid": mid.redis_used_mb, "end": end.redis_used_mb,
                          "max": max(s.redis_used_mb for s in samples),
                          "second_half_slope_mb_per_min": round(slope_per_min([s.redis_used_mb for s in half], times), 3),
                          "end_over_mid": round(end.redis_used_mb / max(1e-9, mid.redis_used_mb), 3)},
        "index_entries": {"mid": mid.index_entries, "end": end.index_entries},
        "stream_length": {"mid": mid.stream_length, "end": end.stream_length},
        "second_half_minutes": round(span_min, 1),
    }


def markdown(samples: list[Sample], summary: dict, args: argparse.Namespace) -> str:
    lines = [f"Soak: {args.duration:.0f} s, {args.workers} simulated workers (time scale {args.time_scale}), "
             f"1 router, concurrency {args.concurrency}, every prompt distinct ({args.prompt_chars} chars)", "",
             "| t (s) | requests | errors | router RSS (MB) | index entries | Redis used (MB) | stream length |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    step = max(1, len(samples) // 12)
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        lines.append(f"| {s.t_s:.0f} | {s.requests} | {s.errors} | {s.router_rss_mb} | {s.index_entries} | "
                     f"{s.redis_used_mb} | {s.stream_length} |")
    r, d = summary["router_rss_mb"], summary["redis_used_mb"]
    lines += ["", f"Second half (from {summary['second_half_minutes']} min before the end): router RSS "
                  f"{r['mid']} -> {r['end']} MB (x{r['end_over_mid']}, slope {r['second_half_slope_mb_per_min']} MB/min); "
                  f"Redis {d['mid']} -> {d['end']} MB (x{d['end_over_mid']}, slope "
                  f"{d['second_half_slope_mb_per_min']} MB/min); {summary['requests']} requests "
                  f"({summary['req_per_s']}/s), {summary['errors']} errors."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=20.0, help="simulated workers run this much faster")
    p.add_argument("--kv-blocks", type=int, default=4096, help="KV blocks per worker (small: evictions happen)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-chars", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--sample-interval", type=float, default=10.0)
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag (repeatable)")
    p.add_argument("--out", default="runs/soak")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples: list[Sample] = []
    with RedisServer(out / "redis") as redis_server, cluster(out / "logs") as c:
        workers = c.workers(args.workers, args.time_scale, kv_blocks=args.kv_blocks, redis=redis_server.url,
                            extra=["--max-num-seqs", "64"])
        router = c.router(workers, "cache_aware", redis=redis_server.url,
                          extra=["--snapshot-interval", "30", *args.router_arg])
        counters = {"requests": 0, "errors": 0}
        start = time.monotonic()
        deadline = start + args.duration

        async def run() -> None:
            await asyncio.gather(
                drive(router.url, "llama-3-8b", args.concurrency, args.prompt_chars, args.max_tokens, deadline,
                      counters),
                sample_loop(router, redis_server.port, start, deadline, args.sample_interval, counters, samples,
                            not args.quiet))

        asyncio.run(run())
    summary = summarise(samples, args.duration)
    report = {"args": vars(args), "summary": summary, "samples": [asdict(s) for s in samples],
              "command": "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None else argv)}
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    text = markdown(samples, summary, args)
    (out / "soak.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
