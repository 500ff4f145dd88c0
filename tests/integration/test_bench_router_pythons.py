"""``bench.router_pythons``, a short run: one router per interpreter in front of the same simulated
workers (here this interpreter twice: the suite has no other with the router's dependencies), each
measured and reported against the first."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from bench.router_pythons import interpreter
from tests.support import ROOT


def test_each_interpreter_s_router_is_measured_and_compared_with_this_one_s():
    proc = subprocess.run([sys.executable, "-m", "bench.router_pythons", "--python", f"again={sys.executable}",
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


def test_no_other_interpreter_is_an_error_and_specs_are_name_equals_executable():
    proc = subprocess.run([sys.executable, "-m", "bench.router_pythons"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--python NAME=EXECUTABLE" in proc.stderr
    assert interpreter("3.12=/opt/py/bin/python3") == ("3.12", "/opt/py/bin/python3")
    for bad in ("3.12", "=/usr/bin/python3", "3.12="):
        with pytest.raises(argparse.ArgumentTypeError):
            interpreter(bad)
