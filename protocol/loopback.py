"""Servers started on this machine: a free loopback port to start one on, and waiting until it answers.

The launcher of ``prefixlb run``, the benchmarks' clusters, the simulator's fidelity check and the
tests all start routers and workers as child processes and poll them (``GET /health``) until
they serve; this is the one copy of both, at the lowest floor every one of them may import.
"""
from __future__ import annotations

import secrets
import socket
import time
import urllib.error
import urllib.request
from typing import Callable

LOOPBACK = "127.0.0.1"


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
PORT_FLOOR = 10000  # the lowest port picked: above the well-known and most registered services' ports
MIN_SPAN = 1000  # fewer ports than this below the ephemeral range: ask the kernel instead


def ephemeral_range(path: str = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The ports the kernel gives outgoing connections and ``bind(0)`` (Linux's default when
    unreadable)."""
    try:
        with open(path, encoding="ascii") as fh:
            low, high = (int(x) for x in fh.read().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, picked at random *below* the kernel's
    ephemeral range where that leaves room: a child process binds the port a moment later, and
    in between an outgoing connection (the tests and benchmarks open thousands) could take a port
    from the ephemeral range, never one outside it. (``bind(0)`` picks from that range: the
    fallback when there is no room below it.)"""
    low, _ = ephemeral_range()
    if low - PORT_FLOOR >= MIN_SPAN:
        for _ in range(100):
            port = PORT_FLOOR + secrets.randbelow(low - PORT_FLOOR)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 1.0, accept: Callable[[bytes], bool] | None = None) -> bool:
    """True when ``GET url`` answers 2xx (and ``accept`` takes its body, when given)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            if not 200 <= resp.status < 300:
                return False
            return accept is None or accept(resp.read())
    except (urllib.error.URLError, OSError, ValueError):  # ValueError: a body ``accept`` cannot parse
        return False


def wait_http_ok(url: str, timeout: float, alive: Callable[[], bool] | None = None,
                 accept: Callable[[bytes], bool] | None = None, interval: float = 0.05) -> bool:
    """Poll :func:`http_ok` until it holds (True), ``timeout`` seconds pass or ``alive()`` turns
    False (False: the caller says which, with what it knows, e.g. the process's log)."""
    deadline = time.monotonic() + timeout
    while alive is None or alive():
        if http_ok(url, accept=accept):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return False
