"""``prefixlb sim`` and ``sweep`` show their progress: the simulator reports requests as it routes
them, and the commands draw a bar on stderr (``--no-progress``: none)."""
from __future__ import annotations

import subprocess
import sys

from bench.sim.fleet import PROGRESS_EVERY, FleetConfig, simulate
from bench.workloads import load_workload
from tests.support import ROOT


def test_the_simulator_reports_every_request_once_in_batches():
    workload = load_workload("system-prompt", 0, 2 * PROGRESS_EVERY + 100, [])
    calls: list[int] = []
    simulate(workload, FleetConfig(workers=2, unit=64, kv_blocks=4000), progress=calls.append)
    assert calls == [PROGRESS_EVERY, PROGRESS_EVERY, 100]


def _run(command: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixlb", command, "--workload", "system-prompt",
                           "--num-requests", "40", "--workers", "2", "--out", str(tmp_path / command), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_sim_and_sweep_draw_a_progress_bar_unless_told_not_to(tmp_path):
    sim = _run("sim", tmp_path)
    assert sim.returncode == 0, sim.stderr
    assert "simulated" in sim.stderr and "40/40" in sim.stderr
    sweep = _run("sweep", tmp_path, "--affinities", "0,1")
    assert sweep.returncode == 0, sweep.stderr
    assert "affinity 1" in sweep.stderr and "80/80" in sweep.stderr
    quiet = _run("sim", tmp_path / "quiet", "--no-progress")
    assert quiet.returncode == 0 and "40/40" not in quiet.stderr
