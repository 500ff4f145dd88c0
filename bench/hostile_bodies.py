"""Parse amplification under fire (issue 13): concurrent huge hostile bodies against a live server.

Starts ``prefixlb router`` in front of one simulated worker (or the worker alone) and sends
``--concurrency`` bodies at once, each ``--mib`` MiB of ``[[],[],...]`` (``--unit`` picks the
repeated value) in a field the server ignores, each sent as fast as the server reads it while
watching for an early answer, while a prober asks ``GET /health`` every 5 ms. Reports each
hostile request's status and time, how much of its body the client had sent by then, the
server's peak RSS growth (``VmHWM`` from /proc) against one body's size and its CPU seconds, and
the health probe's p50/p99 during the attack. Run::

    .venv/bin/python -m bench.hostile_bodies --target router
    .venv/bin/python -m bench.hostile_bodies --target worker
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.process_group import stop_group
from protocol.loopback import free_port, wait_http_ok

ROOT = Path(__file__).resolve().parent.parent


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _post(port: int, body: bytes) -> tuple[int, float, str, int]:
    """POST ``body`` the way a hostile client would: sending as fast as the server reads, and
    watching for an early answer meanwhile. Returns the status, the seconds until the answer
    was read, its error code and how many body bytes had been sent by then."""
    started = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        sock.setblocking(False)
        view, sent, answer = memoryview(body), 0, b""
        while True:
            readable, writable, _ = select.select([sock], [sock] if sent < len(body) else [], [], 120)
            if readable:
                data = sock.recv(1 << 20)
                answer += data
                head, sep, rest = answer.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if not data or (sep and length is not None and len(rest) >= length):
                    break
            elif writable:
                try:
                    sent += sock.send(view[sent:sent + (1 << 20)])
                except (BlockingIOError, InterruptedError):
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    sent = len(body)
        elapsed = time.perf_counter() - started
        status = int(answer.split(b" ", 2)[1])
        code = json.loads(rest[:length]).get("error", {}).get("code") if status >= 400 else ""
        return status, elapsed, str(code), sent
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile_bodies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("router", "worker"), default="router")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--unit", default="[]", help="the value repeated in the junk field ([], {}, 0, \"\")")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="prefixlb-hostile-"))
    wport, rport = free_port(), free_port()
    procs = []
    logs = []
    try:
        for name, cmd, port in (("worker", ["worker", "--simulate", "--port", str(wport)], wport),
                                ("router", ["router", "--port", str(rport), "--worker", f"http://127.0.0.1:{wport}"],
                                 rport)):
            if name == "router" and args.target == "worker":
                continue
            log = open(work / f"{name}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "prefixlb", *cmd], stdout=log,
                                          stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))
            if not wait_http_ok(f"http://127.0.0.1:{port}/health", 120):
                raise RuntimeError(f"{name} did not start")
        target = procs[-1]
        port = rport if args.target == "router" else wport
        size = args.mib << 20
        unit = args.unit.encode()
        junk = b"[" + (unit + b",") * ((size - 64) // (len(unit) + 1)) + unit + b"]"
        body = b'{"model":"llama-3-8b","prompt":"hi","max_tokens":1,"junk":' + junk + b"}"
        time.sleep(1.0)  # let the server settle before reading its baseline
        rss_before = _status_kib(target.pid, "VmRSS")
        hwm_before = _status_kib(target.pid, "VmHWM")
        health: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", "/health")
                conn.getresponse().read()
                conn.close()
                health.append(time.perf_counter() - started)
                time.sleep(0.005)

        cpu_before = _cpu_s(target.pid)
        prober = threading.Thread(target=probe)
        prober.start()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda _: _post(port, body), range(args.concurrency)))
        stop.set()
        prober.join()
        hwm_after = _status_kib(target.pid, "VmHWM")
        cpu_used = _cpu_s(target.pid) - cpu_before
        health.sort()
        report = {"target": args.target, "unit": args.unit, "bodies": args.concurrency, "body_mib": len(body) / 2**20,
                  "statuses": sorted({f"{s} {c}" for s, _, c, _ in results}),
                  "seconds_per_request": [round(t, 3) for _, t, _, _ in results],
                  "mib_sent_before_the_answer": [round(n / 2**20, 1) for *_, n in results],
                  "rss_before_mib": rss_before / 1024, "peak_rss_growth_mib": (hwm_after - max(hwm_before, rss_before)) / 1024,
                  "peak_growth_per_body": (hwm_after - max(hwm_before, rss_before)) * 1024 / len(body),
                  "server_cpu_s": round(cpu_used, 3), "load_average": os.getloadavg(),
                  "health_probes": len(health), "health_p50_ms": 1000 * statistics.median(health),
                  "health_p99_ms": 1000 * health[int(0.99 * (len(health) - 1))]}
        print(json.dumps(report, indent=2))
    finally:
        for p in reversed(procs):
            stop_group(p, 10)
        for log in logs:
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
