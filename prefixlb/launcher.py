"""The local cluster behind ``prefixlb run``: CPU worker processes and a router in front of them.

Workers are child processes (``prefixlb worker ...``) on free loopback ports; the router runs
in this process. On Ctrl-C or SIGTERM the router stops first, then every child gets SIGTERM
(and SIGKILL if it has not exited after a grace period), so nothing is left running.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

from protocol.loopback import free_port, wait_http_ok


class LaunchError(RuntimeError):
    """A worker did not come up."""


@dataclass
class WorkerProcess:
    """One ``prefixlb worker`` child."""

    worker_id: str
    port: int
    popen: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        """True while the child runs."""
        return self.popen.poll() is None


@dataclass
class LocalWorkers:
    """CPU workers started as children of this process."""

    count: int = 2
    model: str = "tiny"
    threads: int = 1
    extra_args: list[str] = field(default_factory=list)
    processes: list[WorkerProcess] = field(default_factory=list)

    def start(self, timeout: float = 180.0) -> list[str]:
        """Start the workers and wait until each answers ``/health``; returns their URLs."""
        for i in range(self.count):
            port = free_port()
            args = [sys.executable, "-m", "prefixlb", "worker", "--model", self.model, "--port", str(port),
                    "--worker-id", f"worker-{i + 1}", "--threads", str(self.threads), "--log-level", "warning",
                    *self.extra_args]
            self.processes.append(WorkerProcess(f"worker-{i + 1}", port, subprocess.Popen(args)))
        deadline = time.monotonic() + timeout
        for w in self.processes:
            if wait_http_ok(w.url + "/health", deadline - time.monotonic(), alive=w.alive):
                continue
            if not w.alive():
                raise LaunchError(f"{w.worker_id} exited with status {w.popen.returncode}")
            raise LaunchError(f"{w.worker_id} did not answer {w.url}/health within {timeout:.0f} s")
        return [w.url for w in self.processes]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child, then SIGKILL whatever is still running after ``grace`` seconds."""
        for w in self.processes:
            if w.alive():
                with contextlib.suppress(ProcessLookupError):
                    w.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for w in self.processes:
            try:
                w.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.popen.kill()
                w.popen.wait(5)


@contextlib.contextmanager
def local_workers(workers: LocalWorkers) -> Iterator[list[str]]:
    """Run ``workers`` for the duration of the block (stopped even on errors or signals)."""
    try:
        yield workers.start()
    finally:
        workers.stop()


def instructions(host: str, port: int, model: str, urls: list[str], admin_token: str) -> str:
    """What to tell the user once the cluster is up."""
    base = f"http://{host}:{port}"
    workers = "\n".join(f"  {u}" for u in urls)
    return f"""
prefixlb is running: a router on {base} in front of {len(urls)} CPU workers ({model} model)
{workers}

Try it:
  curl -s {base}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": "Once upon a time", "max_tokens": 16}}' -D - | grep -i -e x-prefixlb -e usage

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=16,
          messages=[{{"role": "user", "content": "Hello!"}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
  EOF

Routing decisions: response headers X-Prefixlb-Worker, X-Prefixlb-Route-Reason,
X-Prefixlb-Predicted-Cached-Tokens; metrics at {base}/metrics; admin API:
  curl -s {base}/admin/workers -H 'Authorization: Bearer {admin_token}'

Ctrl-C stops the router and the workers.
"""

