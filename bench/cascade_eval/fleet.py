"""The fleet of the HTTP evaluation: two recorded-answer simulated workers and the real router.

``prefixlb worker --simulate --sim-answers FILE --sim-answers-model M`` once for the weak model
and once for the strong one (each serves its model's name and answers every recorded question
with that model's recorded answer), and ``prefixlb router`` in front of both with the virtual
models and the price book of the run. Each is a real process on loopback, in its own process
group, stopped (SIGTERM, then SIGKILL) when the block ends, whatever happened.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from bench.process_group import stop_group
from protocol.loopback import free_port, wait_http_ok

ADMIN_TOKEN = "cascade-bench"


@dataclass(slots=True)
class Fleet:
    """The router's URL and the admin token of this run."""

    router_url: str
    admin_token: str = ADMIN_TOKEN


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    fh = open(log, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "prefixlb", *cmd], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        fh.close()  # the child holds its own descriptor


def _ready(popen: subprocess.Popen, url: str, log: Path, timeout: float = 120.0) -> None:
    if not wait_http_ok(url + "/health", timeout, alive=lambda: popen.poll() is None):
        raise RuntimeError(f"{log.stem} did not start ({url}); its log, {log}:\n"
                           + log.read_text(errors="replace")[-2000:])


@contextlib.contextmanager
def recorded_fleet(dataset: str | Path, weak_model: str, strong_model: str, virtual_models: Path,
                   price_book: Path, log_dir: Path, time_scale: float = 1000.0) -> Iterator[Fleet]:
    """Start the two recorded-answer workers and the router; yield the router's URL."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for role, model, profile in (("weak", weak_model, "llama-3-8b"), ("strong", strong_model, "llama-3-70b")):
            port = free_port()
            log = log_dir / f"worker-{role}.log"
            procs.append(_start(["worker", "--simulate", "--sim-model", profile, "--time-scale", str(time_scale),
                                 "--kv-blocks", "16384", "--sim-answers", str(dataset), "--sim-answers-model", model,
                                 "--worker-id", f"{role}-1", "--port", str(port), "--log-level", "warning"], log))
            urls.append(f"http://127.0.0.1:{port}")
            _ready(procs[-1], urls[-1], log)
        port = free_port()
        log = log_dir / "router.log"
        procs.append(_start(["router", "--port", str(port), *(a for u in urls for a in ("--worker", u)),
                             "--virtual-models", str(virtual_models), "--price-book", str(price_book),
                             "--admin-token", ADMIN_TOKEN, "--max-queue", "4096", "--log-level", "warning"], log))
        url = f"http://127.0.0.1:{port}"
        _ready(procs[-1], url, log)
        yield Fleet(url)
    finally:
        for popen in reversed(procs):
            stop_group(popen)
