"""``prefixlb router --processes N``: N router processes on one port, kept running by this one.

One Python process routes on one core. With ``--processes N`` the command's process becomes a
supervisor: it starts N router processes (each ``python -m prefixlb.processes DIR I``, reading
the settings the supervisor parsed from ``DIR``), which all listen on ``--port`` with
``SO_REUSEPORT`` (the kernel spreads new connections over them) and share the prefix index,
loads and decisions through ``--redis`` exactly as N router replicas do. ``DIR`` is a private
directory (mode 0700, removed at exit) that also holds each process's control socket
(``router/http/siblings.py``: one ``/metrics`` view, one admin API).

- A process that dies is started again after 0.5 s, doubling to 8 s while it keeps dying
  (back to 0.5 s once it has lived a minute); more than :data:`MAX_CRASHES` deaths within
  :data:`CRASH_WINDOW_S` and the supervisor stops them all and exits 1.
- A process that dies before it ever listened, while none has, ends the supervisor with its
  status: settings the processes refuse (2) or a port that is taken (1) fail the command as
  they do with one process.
- SIGTERM/SIGINT to the supervisor are forwarded; it waits ``--shutdown-grace`` + 10 s for the
  processes (their streams get their SSE error events), then kills what is left.
- A process dies with its supervisor (``PR_SET_PDEATHSIG``): a killed supervisor leaves no
  orphans holding the port.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

log = logging.getLogger("prefixlb.router.processes")

MAX_CRASHES = 5
CRASH_WINDOW_S = 60.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
STABLE_AFTER_S = 60.0
CONFIG_FILE = "settings.pickle"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed supervisor may leave its processes (SIGTERM still reaches them)


class _Slot:
    """One of the N processes: what runs there now and how often it died."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.backoff_s = FIRST_BACKOFF_S


class Supervisor:
    """Starts, watches and stops the router processes of one ``prefixlb router --processes N``."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.count = cfg.processes
        self.dir = tempfile.mkdtemp(prefix="prefixlb-router-")  # 0700: the control sockets are the admin API
        self.slots = [_Slot(i) for i in range(self.count)]
        self.crashes: list[float] = []
        self.stopping = asyncio.Event()
        self.status: int | None = None

    def _ever_ready(self) -> bool:
        return any(os.path.exists(os.path.join(self.dir, f"process-{i}.ready")) for i in range(self.count))

    async def _start(self, slot: _Slot) -> None:
        slot.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixlb.processes", self.dir, str(slot.index),
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        slot.started_at = time.monotonic()
        log.info("event=router_process_started process=%d pid=%d", slot.index, slot.proc.pid)

    async def _watch(self, slot: _Slot) -> None:
        while not self.stopping.is_set():
            assert slot.proc is not None
            rc = await slot.proc.wait()
            if self.stopping.is_set():
                return
            now = time.monotonic()
            if rc != 0 and not self._ever_ready():
                log.error("event=router_process_failed_to_start process=%d status=%d", slot.index, rc)
                self.status = rc if rc > 0 else 1
                self.stopping.set()
                return
            self.crashes = [t for t in self.crashes if now - t < CRASH_WINDOW_S] + [now]
            if len(self.crashes) > MAX_CRASHES:
                log.error("event=router_processes_crash_loop deaths=%d window_s=%g", len(self.crashes), CRASH_WINDOW_S)
                self.status = 1
                self.stopping.set()
                return
            if now - slot.started_at >= STABLE_AFTER_S:
                slot.backoff_s = FIRST_BACKOFF_S
            log.warning("event=router_process_died process=%d status=%d restart_in_s=%g", slot.index, rc,
                        slot.backoff_s)
            try:
                await asyncio.wait_for(self.stopping.wait(), slot.backoff_s)
                return
            except asyncio.TimeoutError:
                pass
            slot.backoff_s = min(MAX_BACKOFF_S, slot.backoff_s * 2)
            await self._start(slot)

    async def run(self) -> int:
        """Run the processes until SIGTERM/SIGINT (0) or until they cannot be kept running."""
        path = os.path.join(self.dir, CONFIG_FILE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the settings hold secrets
        with os.fdopen(fd, "wb") as f:
            pickle.dump(self.cfg, f)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        watchers: list[asyncio.Task] = []
        try:
            for slot in self.slots:
                await self._start(slot)
            watchers = [asyncio.create_task(self._watch(slot)) for slot in self.slots]
            log.info("event=router_processes_started processes=%d port=%d", self.count, self.cfg.port)
            await self.stopping.wait()
        finally:
            await self._stop_all()
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            shutil.rmtree(self.dir, ignore_errors=True)
        return self.status if self.status is not None else 0

    async def _stop_all(self) -> None:
        running = [s.proc for s in self.slots if s.proc is not None and s.proc.returncode is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = float(getattr(self.cfg, "shutdown_grace", 25.0)) + 10.0
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), deadline)
        except asyncio.TimeoutError:
            for proc in running:
                if proc.returncode is None:
                    log.warning("event=router_process_killed pid=%d", proc.pid)
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in running))


async def supervise(cfg: Any) -> int:
    """``prefixlb router --processes N`` (N > 1): run and watch N router processes."""
    return await Supervisor(cfg).run()


def child_main(control_dir: str, index: int) -> int:
    """One router process: the supervisor's settings, the shared ports, its control socket."""
    from prefixlb.aio import run as run_loop
    from prefixlb.commands.router import settings_errors
    from protocol.log_format import configure_logging
    from router.app import serve
    from router.http.siblings import ProcessSlot

    invalid = settings_errors()

    with open(os.path.join(control_dir, CONFIG_FILE), "rb") as f:
        cfg = pickle.load(f)  # written by our own supervisor, in a directory only this user can open
    configure_logging(cfg.log_level, cfg.log_format)
    try:
        return run_loop(serve(cfg, slot=ProcessSlot(index, cfg.processes, control_dir)))
    except invalid as exc:
        print(f"prefixlb router (process {index}): {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken by something that is not one of us
        print(f"prefixlb router (process {index}): cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1], int(sys.argv[2])))
