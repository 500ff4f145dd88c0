"""``bench.router_pythons``, a short run: one router per interpreter in front of the same simulated
workers, each measured and reported against the first. The other interpreter is this one behind a
wrapper that notes each command it runs (the suite has no other Python with the router's
dependencies): the named interpreter, not this one, must build the compiled loops and run the router."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from bench.cluster import interpreter
from tests.support import ROOT


def test_each_interpreter_s_router_is_measured_and_compared_with_this_one_s(tmp_path):
    ran = tmp_path / "ran"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {ran}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "bench.router_pythons", "--python", f"again={wrapper}",
                           "--rounds", "2", "--requests", "200", "--sequential", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "µs" not in line]
    assert len(rows) == 2 and "(this one)" in rows[0] and rows[1].startswith("| again |")
    for row in rows:
        cpu, rounds, ratio, req_s, first = re.fullmatch(
            r"\| [^|]+ \| (\d+) \((\d+, \d+)\) \| ([\d.]+×|-) \| (\d+) \| ([\d.]+) \|", row).groups()
        assert float(req_s) > 0 and float(first) > 0
    assert rows[0].split("|")[3].strip() in ("1.00×", "-")  # - : less than a clock tick of CPU
    commands = ran.read_text().splitlines()
    assert any(c.startswith("setup.py -q build_ext --inplace") for c in commands), commands
    assert any(c.startswith("-m prefixlb router ") for c in commands), commands


def test_no_other_interpreter_is_an_error_and_specs_are_name_equals_executable():
    proc = subprocess.run([sys.executable, "-m", "bench.router_pythons"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--python NAME=EXECUTABLE" in proc.stderr
    assert interpreter("3.12=/opt/py/bin/python3") == ("3.12", "/opt/py/bin/python3")
    for bad in ("3.12", "=/usr/bin/python3", "3.12="):
        with pytest.raises(argparse.ArgumentTypeError):
            interpreter(bad)
