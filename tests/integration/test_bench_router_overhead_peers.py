"""``bench.router_overhead --peers``, a short run: every router in front of the same simulated
workers, every measure reported for each, and the direct baseline beside them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers.launch import DEFAULT_VENV
from tests.support import ROOT

PEERS_VENV = Path(os.environ.get("PREFIXLB_PEERS_VENV", DEFAULT_VENV))


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--peers", "--rounds", "1", "--requests", "10",
                           "--workers", "2", "--concurrency", "4", "--json", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, _, blob = proc.stdout.partition("\n{")
    assert "| direct |" in table
    return json.loads("{" + blob)


def _assert_measured(row: dict) -> None:
    # CPU time comes in clock ticks (10 ms): a short run of a frugal router may read 0
    assert row["cpu_us_per_request"] >= 0 and len(row["cpu_us_rounds"]) == 1
    assert row["req_per_s"] > 0
    assert row["unloaded_p50_ms"] > 0 and row["first_chunk_p50_ms"] > 0


def test_peers_mode_measures_prefixlb_and_a_baseline_checkout_against_the_workers_directly():
    result = _run("--routers", "prefixlb", "--baseline", str(ROOT))

    assert list(result["targets"]) == ["direct", "prefixlb", "prefixlb@baseline"]
    _assert_measured(result["targets"]["prefixlb@baseline"])
    direct, prefixlb = result["targets"]["direct"], result["targets"]["prefixlb"]
    _assert_measured(prefixlb)
    assert prefixlb["cpu_us_per_request"] > 0  # 200 requests: tens of ms of CPU
    assert prefixlb["added_p50_ms"] == pytest.approx(prefixlb["unloaded_p50_ms"] - direct["unloaded_p50_ms"])
    assert prefixlb["first_chunk_vs_direct"] == pytest.approx(
        prefixlb["first_chunk_p50_ms"] / direct["first_chunk_p50_ms"])
    assert "cpu_us_per_request" not in direct and direct["req_per_s"] > 0


def test_peers_mode_runs_this_checkout_s_router_on_another_named_interpreter_too(tmp_path):
    # The other interpreter is this one behind a wrapper that notes its commands: it, not this
    # one, must build the compiled loops and run the router measured as prefixlb@again.
    ran = tmp_path / "ran"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {ran}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    result = _run("--routers", "prefixlb,python-floor", "--python", f"again={wrapper}")

    assert list(result["targets"]) == ["direct", "prefixlb", "python-floor", "prefixlb@again", "python-floor@again"]
    _assert_measured(result["targets"]["prefixlb@again"])
    _assert_measured(result["targets"]["python-floor@again"])
    commands = ran.read_text().splitlines()
    assert any(c.startswith("setup.py -q build_ext --inplace") for c in commands), commands
    assert sum(c.startswith("-m prefixlb router ") for c in commands) == 1, commands
    assert sum(c.startswith("-m bench.peers.floor ") for c in commands) == 1, commands


def test_peers_mode_measures_the_python_floor_streaming_and_not():
    result = _run("--routers", "python-floor")

    assert list(result["targets"]) == ["direct", "python-floor"]
    _assert_measured(result["targets"]["python-floor"])


@pytest.mark.skipif(not (PEERS_VENV / "bin" / "vllm-router").exists(),
                    reason="peer routers not installed (bench/peers/install.sh; PREFIXLB_PEERS_VENV)")
def test_peers_mode_measures_sglang_router_and_vllm_router_in_the_same_run():
    result = _run("--peers-venv", str(PEERS_VENV))

    assert list(result["targets"]) == ["direct", "prefixlb", "sglang-router", "vllm-router", "python-floor"]
    for name in ("prefixlb", "sglang-router", "vllm-router", "python-floor"):
        _assert_measured(result["targets"][name])


def test_streaming_peers_mode_counts_every_event_of_every_stream():
    proc = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--peers", "--streaming", "--rounds", "1",
                           "--requests", "10", "--workers", "2", "--concurrency", "4", "--json",
                           "--routers", "prefixlb,python-floor"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, _, blob = proc.stdout.partition("\n{")
    assert "| prefixlb |" in table and "| python-floor |" in table
    result = json.loads("{" + blob)
    assert list(result["targets"]) == ["prefixlb", "python-floor"]
    for row in result["targets"].values():
        assert row["events_per_request"] == 64  # every token's event, through each router, counted once
        assert row["cpu_us_per_request"] >= 0 and row["cpu_us_per_event"] >= 0
        assert len(row["cpu_us_per_event_rounds"]) == 1


def test_peers_mode_refuses_an_interpreter_named_like_the_baseline():
    proc = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--peers", "--python",
                           f"baseline={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "'baseline' is --baseline's" in proc.stderr
