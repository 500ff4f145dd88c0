"""``bench/cpu_sample.py``: CPU-time stack samples of a program, and their shares."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from bench.cpu_sample import report, shares
from tests.support import ROOT


def test_a_program_burning_cpu_in_one_function_is_sampled_there_and_sleep_is_not(tmp_path):
    script = tmp_path / "burn.py"
    script.write_text(textwrap.dedent("""
        import sys, time

        def burn():
            t = time.process_time()
            while time.process_time() - t < 0.4:
                sum(range(1000))

        def idle():
            time.sleep(0.4)  # wall time, no CPU: never sampled

        idle()
        burn()
        sys.exit(3)
    """))
    out = tmp_path / "stacks.txt"
    proc = subprocess.run([sys.executable, "-m", "bench.cpu_sample", "--out", str(out), "--interval", "0.002",
                           "--", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60)

    assert proc.returncode == 3, proc.stderr  # the program's own exit status
    total, own, within = shares(str(out))
    assert total >= 50  # ~0.4 s of CPU every 2 ms
    burn = next(frame for frame in within if frame.startswith("burn ("))
    assert within[burn] / total > 0.8
    assert not any(frame.startswith("idle (") for frame in within)
    assert "burn (" in report(str(out), 5)
    # what the run gave, against what was asked (the kernel's tick may space samples further)
    said = re.search(r"cpu_sample: (\d+) samples in ([\d.]+) s of CPU: one every ([\d.]+) ms \(asked: 2.0 ms\)",
                     proc.stderr)
    assert said is not None, proc.stderr
    assert int(said.group(1)) == total and float(said.group(2)) >= 0.4
    assert float(said.group(3)) >= 2.0 * 0.9  # never more often than asked
