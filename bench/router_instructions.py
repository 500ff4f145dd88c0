"""Instructions a router process executes per proxied request, counted by valgrind's callgrind.

    python -m bench.router_instructions                          # this checkout, ~3 min
    python -m bench.router_instructions --source /tmp/base       # another checkout (its extensions built)

Four simulated workers and one ``prefixlb router`` (``cache_aware``, ``--log-level warning``)
run under ``valgrind --tool=callgrind``; a closed loop of non-streaming requests at
concurrency 32 (``bench/peers/overhead.py``'s) goes through it twice, in two runs of the
router: ``--requests`` a and b requests (each after a warm-up of 128). The router's
instructions per request are (Ir of run b - Ir of run a) / (b - a): start-up and warm-up cancel
out. Unlike CPU time on a shared machine, the count hardly moves with the neighbours' load, so
two checkouts compare in one run each. Its limits: user-space instructions only (no system
calls, no cache misses), and the router runs ~50x slower under valgrind, so requests queue more
than at full speed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.cluster import ROOT, Cluster, free_port, wait_http_ok
from bench.peers.overhead import Target, closed_loop


def router_instructions(source: Path, workers: list[str], requests: int, out: Path) -> int:
    """Ir of one router run (start-up, warm-up and ``requests`` requests) from ``source``."""
    port = free_port()
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=no", "--dump-instr=no", f"--callgrind-out-file={out}",
           sys.executable, "-m", "prefixlb", "router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "cache_aware", "--log-level", "warning"]
    for url in workers:
        cmd += ["--worker", url]
    with open(f"{out}.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=source, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_http_ok(url + "/health", 900, alive=lambda: proc.poll() is None):
            raise RuntimeError(f"the router under valgrind did not start: see {out}.log")
        time.sleep(2)  # its first probes of the workers
        asyncio.run(closed_loop(Target(str(source), [url]), requests, 32))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(600)
    found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
    if found is None:
        raise RuntimeError(f"no instruction count in {out}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router_instructions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=ROOT, help="the checkout whose router runs")
    parser.add_argument("--requests", type=int, nargs=2, default=(300, 2300), metavar=("A", "B"))
    args = parser.parse_args(argv)
    a, b = args.requests
    workdir = Path(tempfile.mkdtemp(prefix="router-instructions-"))
    c = Cluster(workdir)
    try:
        urls = [w.url for w in c.workers(4, 1000)]
        ir_a = router_instructions(args.source, urls, a, workdir / "a.out")
        ir_b = router_instructions(args.source, urls, b, workdir / "b.out")
    finally:
        c.stop()
    print(f"{args.source}: {(ir_b - ir_a) / (b - a):,.0f} instructions per request "
          f"(Ir {ir_a:,} after {a} requests, {ir_b:,} after {b})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
