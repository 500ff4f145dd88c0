"""A live worker process with a CPU KV tier (``--cpu-kv-blocks``): usage counts loaded tokens as
cached, headers and metrics split them by medium, a bad tier flag is refused at start."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.integration.worker_client import call
from tests.support import free_port, processes, spawn

A = [(7 * i + 3) % 250 + 1 for i in range(96)]  # 6 blocks of 16 token ids
B = [(11 * i + 5) % 250 + 1 for i in range(96)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    port = free_port()
    args = ["worker", "--model", "tiny", "--port", str(port), "--worker-id", "tiered", "--kv-blocks", "8",
            "--cpu-kv-blocks", "32", "--threads", "1"]
    with processes() as procs:
        procs.append(spawn(args, tmp_path_factory.mktemp("tiered"), "tiered-worker", port=port, timeout=120))
        yield procs[0].url


def _complete(url: str, prompt: list[int], stream: bool = False):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    reply = call(url + "/v1/completions", "POST", body, timeout=60)
    assert reply.status == 200, reply.raw
    return reply


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} not exposed"
    return float(match.group(1))


def test_a_prefix_loaded_from_the_tier_is_cached_in_usage_and_split_in_headers_and_metrics(worker):
    first = _complete(worker, A)
    assert first.json["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (first.headers["x-prefixlb-cached-tokens-gpu"], first.headers["x-prefixlb-cached-tokens-cpu"]) == ("0", "0")
    _complete(worker, B)  # evicts A's blocks from the 8-block GPU pool into the tier
    again = _complete(worker, A, stream=True)
    usage = [c for c in again.sse() if isinstance(c, dict) and c.get("usage")][-1]["usage"]
    gpu, cpu = int(again.headers["x-prefixlb-cached-tokens-gpu"]), int(again.headers["x-prefixlb-cached-tokens-cpu"])
    assert cpu > 0 and gpu + cpu == usage["prompt_tokens_details"]["cached_tokens"] == 96 - 16
    metrics = call(worker + "/metrics").raw.decode()
    assert _metric(metrics, "prefixlb_worker_kv_tier_loaded_tokens_total") == cpu
    assert _metric(metrics, "prefixlb_worker_kv_tier_stored_blocks_total") >= cpu // 16
    assert _metric(metrics, "prefixlb_worker_kv_tier_blocks") == 32
    assert _metric(metrics, "prefixlb_worker_cached_prompt_tokens_by_medium_total", '{medium="cpu"}') == cpu
    load = call(worker + "/load").json
    assert load["kv_tier_load_tokens_per_s"] > 0


def test_a_malformed_tier_size_is_refused_at_start():
    proc = subprocess.run([sys.executable, "-m", "prefixlb", "worker", "--cpu-kv-memory", "lots"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "lots" in proc.stderr
