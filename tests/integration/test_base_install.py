"""`pip install prefixlb` into a fresh virtualenv: the router alone, and it runs.

Slow (pip builds the wheel and fetches a dozen small distributions): `make test-slow` runs it.
The suite's fast stand-in is tests/unit/test_packaging.py (the wheel metadata, and the commands
run with every module outside the base requirements made unimportable).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.packaging_support import BASE, NOT_IN_BASE, OUR_PACKAGES, normalize
from tests.support import ROOT, Proc, free_port, http_ok, processes, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("base-install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in OUR_PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    proc = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", str(src)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env


def _clean_env() -> dict[str, str]:
    """The environment without this checkout's or this virtualenv's paths."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_a_fresh_pip_install_prefixlb_has_the_router_dependencies_and_no_torch(venv):
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                          capture_output=True, text=True, timeout=120, env=_clean_env())
    installed = {normalize(d["name"]) for d in json.loads(proc.stdout)}
    assert set(BASE) | {"prefixlb"} <= installed
    assert installed & NOT_IN_BASE == set()


def _start(venv: Path, args: list[str], port: int, log: Path) -> Proc:
    # cwd outside the checkout: the installed copy runs, not the source tree.
    popen = subprocess.Popen([str(venv / "bin" / "prefixlb"), *args], stdout=open(log, "wb"),
                             stderr=subprocess.STDOUT, cwd=venv, env=_clean_env())
    proc = Proc(args=args, popen=popen, log=log, port=port)
    wait_for(lambda: not proc.alive() or http_ok(proc.url + "/health"), 60, what=f"{args[0]} at {proc.url}")
    assert proc.alive(), proc.output()[-3000:]
    return proc


def test_the_installed_router_serves_the_installed_simulated_worker(venv, tmp_path):
    help_ = subprocess.run([str(venv / "bin" / "prefixlb"), "router", "--help"], capture_output=True,
                           text=True, timeout=120, cwd=venv, env=_clean_env())
    assert help_.returncode == 0 and help_.stdout.startswith("usage: prefixlb router"), help_.stderr
    worker_port, router_port = free_port(), free_port()
    with processes() as procs:
        procs.append(_start(venv, ["worker", "--simulate", "--gpu", "H100-80G", "--time-scale", "1000", "--worker-id", "sim-1",
                                   "--port", str(worker_port)], worker_port, tmp_path / "worker.log"))
        procs.append(_start(venv, ["router", "--port", str(router_port),
                                   "--worker", f"http://127.0.0.1:{worker_port}"], router_port, tmp_path / "router.log"))
        request = urllib.request.Request(
            f"http://127.0.0.1:{router_port}/v1/completions", method="POST",
            data=json.dumps({"model": "llama-3-8b", "prompt": "hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert (resp.status, resp.headers["X-Prefixlb-Worker"]) == (200, "sim-1")
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4


def test_the_installed_worker_command_asks_for_the_worker_extra(venv):
    proc = subprocess.run([str(venv / "bin" / "prefixlb"), "worker", "--model", "tiny", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, cwd=venv, env=_clean_env())
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith("pip install 'prefixlb[worker]'")
