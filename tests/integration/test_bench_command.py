"""``prefixlb bench`` against a worker that requires an API key: the key from ``--api-key`` or
``OPENAI_API_KEY``, the chat endpoint, and a run directory that never holds the key."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT, free_port, processes, spawn

KEY = "bench-key-123"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    port = free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--time-scale", "1000", "--served-model-name", "m",
                            "--api-key", KEY, "--port", str(port)], tmp_path_factory.mktemp("bench"), "worker",
                           port=port))
        yield procs[0].url


def _bench(url: str, out, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run([sys.executable, "-m", "prefixlb", "bench", "--target", url, "--workload", "system-prompt",
                           "--num-requests", "6", "--no-progress", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**environ, **(env or {})})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_sends_the_api_key_and_drives_either_endpoint(worker, tmp_path, endpoint):
    done = _bench(worker, tmp_path, "--api-key", KEY, "--endpoint", endpoint)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["error"] is None for r in records), records
    assert all(r["ttft_ms"] > 0 and r["prompt_tokens"] > 0 for r in records), records
    assert KEY not in "".join(p.read_text() for p in tmp_path.iterdir() if p.suffix in (".json", ".jsonl", ".md"))


def test_bench_reads_the_key_from_openai_api_key_and_says_so_when_it_is_missing(worker, tmp_path):
    assert _bench(worker, tmp_path / "env", env={"OPENAI_API_KEY": KEY}).returncode == 0
    done = _bench(worker, tmp_path / "none")
    assert done.returncode == 2
    assert "answered 401 (give the API key with --api-key or OPENAI_API_KEY)" in done.stderr
