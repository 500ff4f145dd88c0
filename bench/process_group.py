"""Child servers in their own process group: stop the whole group, count its CPU time.

Servers the benchmarks start (peer routers, vLLM, prefixlb workers) are started with
``start_new_session=True``, so each leads a process group that also holds its children
(vLLM's engine core and worker processes).
"""
from __future__ import annotations

import os
import signal
import subprocess


def stop_group(popen: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process group ``popen`` leads, then SIGKILL after ``timeout`` seconds."""
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, signal.SIGTERM)
        popen.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(10)
    except ProcessLookupError:
        pass


def group_cpu_by_process(pgid: int) -> dict[str, float]:
    """User + system CPU seconds per process name (``comm``) of the live processes in group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        fields = rest.split()
        if int(fields[2]) == pgid:  # after the command: state, ppid, pgrp, ...; utime, stime at 11, 12
            name = head.split("(", 1)[1]
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux /proc)."""
    return sum(group_cpu_by_process(pgid).values())
