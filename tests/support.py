"""Test support: free ports, real child processes, polling with a deadline (never bare sleeps).

``free_port`` and the readiness poll are ``protocol/loopback.py``'s, the ones the launcher and
the benchmarks use; tests import them from here.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

from protocol.loopback import free_port, http_ok, wait_http_ok

__all__ = ["ROOT", "Proc", "free_port", "http_ok", "processes", "run_isolated", "spawn", "wait_for"]

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f": {last_exc!r}" if last_exc else ""))


@dataclass
class Proc:
    """A child process started by :func:`spawn`; its output goes to ``log``."""

    args: list[str]
    popen: subprocess.Popen
    log: Path
    port: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def spawn(args: list[str], log_dir: Path, name: str, port: int | None = None,
          ready_path: str | None = "/health", timeout: float = 60.0,
          env: dict[str, str] | None = None) -> Proc:
    """Start ``python -m prefixlb <args>`` and wait until ``GET ready_path`` answers 2xx."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    fh = open(log, "wb")
    popen = subprocess.Popen([sys.executable, "-m", "prefixlb", *args], stdout=fh,
                             stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    proc = Proc(args=args, popen=popen, log=log, port=port)
    if ready_path is not None and port is not None and not wait_http_ok(proc.url + ready_path, timeout,
                                                                         alive=proc.alive):
        if not proc.alive():
            raise RuntimeError(f"{name} exited early:\n{proc.output()[-4000:]}")
        proc.stop()
        raise TimeoutError(f"timed out after {timeout}s waiting for {name} at {proc.url}{ready_path}")
    return proc


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """A list to put started processes in; all are stopped on exit, even on failure."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@contextlib.asynccontextmanager
async def completions_server(handler: Callable[[Any], Any]) -> AsyncIterator[str]:
    """A loopback aiohttp server answering ``POST /v1/completions`` with ``handler``; yields its URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def run_isolated(code: str) -> str:
    """Run ``code`` in a fresh interpreter with the debug allocators (freed memory is overwritten,
    so a use after free shows; a crash fails the test, not the test run); its stdout."""
    import textwrap
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONMALLOC": "debug"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return done.stdout
