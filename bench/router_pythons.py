"""What the router costs on each CPython: the same code, the same workers, one router per interpreter.

    python3.12 -m venv /tmp/r312 && /tmp/r312/bin/pip install setuptools -r docker/requirements-router.txt
    python -m bench.router_pythons --python 3.12=/tmp/r312/bin/python [--python 3.13=...] [--rounds 4]

The router image (``docker/Dockerfile.router``) picks its interpreter with ``PYTHON_IMAGE``; the
suite and every other benchmark run on this one. This measures what that choice costs: four
simulated workers (this interpreter) and one ``prefixlb router`` per interpreter in front of them
(this one first, then each ``--python NAME=EXECUTABLE``, whose compiled loops are built in place
first: ``setup.py build_ext --inplace``, one ``.so`` per interpreter beside the sources), then
``--rounds`` rounds of ``--requests`` non-streaming requests at concurrency 32 to each router in
turn, the order rotated every round (``bench/peers/overhead.py``'s closed loop), and sequential
streaming requests for the time to the first SSE event. Reported: each router's CPU time per
request (median over rounds, its process's user + system time), req/s, first-chunk p50, and each
CPU time over this interpreter's (the ratio is the point; the machine is shared).
``python -m bench.router_instructions`` run by another interpreter counts its instructions.
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile

from bench.cluster import ROOT, build_extensions, cluster, interpreter
from bench.peers.overhead import Target, closed_loop, sequential
from bench.stats import rotated


def measure(pythons: list[tuple[str, str]], rounds: int, requests: int, sequential_n: int) -> list[Target]:
    """One router per interpreter in front of the same four workers: their targets, measured."""
    with tempfile.TemporaryDirectory(prefix="router-pythons-") as logs, cluster(logs) as c:
        fleet = c.workers(4, time_scale=1000)
        targets = []
        for i, (name, exe) in enumerate(pythons):
            proc = c.router(fleet, "cache_aware", source=ROOT, python=exe, name=f"router-{i}")
            targets.append(Target(name, [proc.url], pgid=proc.popen.pid))
        for r in range(rounds):
            for t in rotated(targets, r):
                asyncio.run(closed_loop(t, requests, 32))
        asyncio.run(sequential(targets, sequential_n, True, warmup=20))
    return targets


def report(targets: list[Target]) -> str:
    """A markdown table; the first target is the ratios' base."""
    base = statistics.median(targets[0].cpu_us)  # (0 for a run shorter than a clock tick of CPU)
    lines = ["| interpreter | router CPU µs/request (rounds) | × the first | req/s, c=32 | first chunk p50 ms |",
             "|---|---|---|---|---|"]
    for t in targets:
        cpu = statistics.median(t.cpu_us)
        lines.append(f"| {t.name} | {cpu:.0f} ({', '.join(f'{x:.0f}' for x in t.cpu_us)}) | "
                     f"{f'{cpu / base:.2f}×' if base else '-'} "
                     f"| {statistics.median(t.req_per_s):.0f} | {1000 * statistics.median(t.first_chunk):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router_pythons", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", type=interpreter, action="append", default=[], metavar="NAME=EXECUTABLE",
                        help="another interpreter to run a router on (repeatable)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3000, help="requests per router per round")
    parser.add_argument("--sequential", type=int, default=300, help="streaming requests per router, one at a time")
    args = parser.parse_args(argv)
    if not args.python:
        parser.error("name at least one --python NAME=EXECUTABLE to compare with this interpreter")
    for _, exe in args.python:
        build_extensions(exe)
    this = (f"{platform.python_implementation()} {platform.python_version()} (this one)", sys.executable)
    targets = measure([this, *args.python], args.rounds, args.requests, args.sequential)
    print(report(targets))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
