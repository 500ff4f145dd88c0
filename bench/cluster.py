"""Local processes for HTTP benchmarks: a fleet of simulated workers and a router in front of it.

Every process listens on 127.0.0.1 at a free port, logs to a file, and is stopped (its whole
process group) when the context exits, even on failure.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from bench.peers.launch import DEFAULT_VENV, ROOT, peer_env, start_peer
from protocol.loopback import free_port, wait_http_ok


def interpreter(spec: str) -> tuple[str, str]:
    """``NAME=EXECUTABLE`` (a command line's ``--python``) as (name, executable)."""
    name, sep, exe = spec.partition("=")
    if not sep or not name or not exe:
        raise argparse.ArgumentTypeError(f"expected NAME=EXECUTABLE, got {spec!r}")
    return name, exe


def build_extensions(exe: str, source: Path = ROOT) -> None:
    """The router's compiled loops for the interpreter ``exe`` (its ABI's ``.so`` files, beside the
    sources of the checkout ``source``)."""
    subprocess.run([exe, "setup.py", "-q", "build_ext", "--inplace"], cwd=source, check=True,
                   stdout=subprocess.DEVNULL)


class ClusterError(RuntimeError):
    """A process did not come up (its log tail is in the message)."""


class RedisServer:
    """A private ``redis-server`` on a free loopback port, without persistence (a restart loses
    everything, as a crashed cache node comes back); ``with RedisServer(dir) as r:`` or start/stop."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = Path(workdir)
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterError("redis-server is not installed (make redis installs it)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "redis.log", "ab") as log:
            self.popen = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no", "--dir", str(self.workdir)],
                                          stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self.ping():
            if time.monotonic() > deadline:
                raise ClusterError(f"redis-server on {self.port} did not answer within 10 s")
            time.sleep(0.05)

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)
        self.popen = None

    def used_memory(self) -> int:
        import redis

        return int(redis.Redis(port=self.port).info("memory")["used_memory"])

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Process:
    """One started process."""

    name: str
    popen: subprocess.Popen
    log: Path
    url: str

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL after ``timeout``."""
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)

    def wait_ready(self, path: str, timeout: float) -> None:
        """Poll ``url + path`` until it answers 2xx; raise with the log tail if it never does."""
        if wait_http_ok(self.url + path, timeout, alive=lambda: self.popen.poll() is None):
            return
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        self.stop()
        raise ClusterError(f"{self.name} did not become ready at {self.url}{path}:\n{tail}")


@dataclass
class Cluster:
    """Started processes, stopped together."""

    log_dir: Path
    procs: list[Process] = field(default_factory=list)

    def _start(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> Process:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        fh = open(log, "wb")
        popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        proc = Process(name, popen, log, f"http://127.0.0.1:{port}")
        self.procs.append(proc)
        return proc

    def workers(self, n: int, time_scale: float, kv_blocks: int | None = None, extra: Sequence[str] = (),
                redis: str | None = None, redis_prefix: str | None = None, prefix: str = "sim",
                timeout: float = 60.0) -> list[Process]:
        """Start ``n`` simulated workers (ids ``{prefix}-0`` ...) and wait until all are healthy."""
        out = []
        for i in range(n):
            port = free_port()
            cmd = [sys.executable, "-m", "prefixlb", "worker", "--simulate", "--host", "127.0.0.1",
                   "--port", str(port), "--worker-id", f"{prefix}-{i}", "--time-scale", str(time_scale),
                   "--log-level", "warning", *extra]
            if kv_blocks is not None:
                cmd += ["--kv-blocks", str(kv_blocks)]
            if redis:
                cmd += ["--redis", redis, "--redis-prefix", redis_prefix or "prefixlb:"]
            out.append(self._start(f"{prefix}-{i}", cmd, port))
        for p in out:
            p.wait_ready("/health", timeout)
        return out

    def router(self, workers: Sequence[Process], policy: str, affinity: float | None = None,
               redis: str | None = None, redis_prefix: str | None = None, extra: Sequence[str] = (),
               timeout: float = 60.0, source: Path | None = None, python: str | None = None,
               name: str | None = None) -> Process:
        """Start ``prefixlb router`` in front of ``workers`` (``source``: the code of another
        checkout of prefixlb, e.g. an older commit's, instead of this one's; ``python``: another
        interpreter than this one, with the router's dependencies; ``name``: its log's name)."""
        port = free_port()
        cmd = [python or sys.executable, "-m", "prefixlb", "router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", policy, "--log-level", "warning", *extra]
        for w in workers:
            cmd += ["--worker", w.url]
        if affinity is not None:
            cmd += ["--affinity", str(affinity)]
        if redis:
            cmd += ["--redis", redis, "--redis-prefix", redis_prefix or "prefixlb:"]
        proc = self._start(name or f"router-{policy}" + (f"-{Path(source).name}" if source else ""), cmd, port,
                           cwd=source)
        proc.wait_ready("/health", timeout)
        return proc

    def peer(self, name: str, policy: str, workers: Sequence[Process], timeout: float = 60.0,
             venv: Path = DEFAULT_VENV) -> Process:
        """Start a peer router (sglang-router / vllm-router, from ``venv``) in front of ``workers``."""
        port, metrics = free_port(), free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}-{policy}.log"
        popen = start_peer(name, port, policy, [w.url for w in workers], metrics, log, venv)
        proc = Process(f"{name}-{policy}", popen, log, f"http://127.0.0.1:{port}")
        self.procs.append(proc)
        proc.wait_ready("/v1/models", timeout)
        return proc

    def floor(self, workers: Sequence[Process], timeout: float = 30.0, python: str | None = None,
              name: str = "python-floor") -> Process:
        """Start ``bench/peers/floor.py`` (the floor of a Python router) in front of ``workers``
        (``python``: another interpreter than this one)."""
        port = free_port()
        proc = self._start(name, [python or sys.executable, "-m", "bench.peers.floor", "--port", str(port),
                                            *[w.url for w in workers]], port, cwd=ROOT)
        proc.wait_ready("/v1/models", timeout)
        return proc

    def stop(self) -> None:
        """Stop every process, newest first."""
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


@contextlib.contextmanager
def cluster(log_dir: str | Path) -> Iterator[Cluster]:
    """A :class:`Cluster` whose processes are all stopped on exit."""
    c = Cluster(Path(log_dir))
    try:
        yield c
    finally:
        c.stop()


__all__ = ["Cluster", "ClusterError", "Process", "cluster", "peer_env"]
