"""Where a Python process spends its CPU time: stacks sampled every ``--interval`` of CPU time.

    python -m bench.cpu_sample --out /tmp/router.stacks -- -m prefixlb router --worker ...
    python -m bench.cpu_sample --report /tmp/router.stacks [--top 40]

The first form runs the program (``-m module`` or a script path, with its arguments) with a
``SIGPROF`` interval timer, which counts the process's user + system CPU time, not wall time:
every ``--interval`` seconds of CPU the signal handler records the Python stack in which it lands,
and the stacks are written at exit (``"frame;frame;... count"`` lines, the collapsed format flame
graph tools read). The second form prints each function's share of the samples, by itself and
with what it calls.

Why not py-spy or cProfile for a router under load on a busy machine: py-spy samples wall time,
and a process preempted inside a system call (a socket write that wakes the worker on a
saturated box) is charged to that call; cProfile's own cost per call (two clock reads) inflates
code made of many small calls several-fold. CPU-time samples have neither bias. Their limits:
the handler runs between bytecodes in the main thread, so time inside one C call (a regex, a
``send``) is charged to the Python line that made it, and other threads are not sampled. More
precisely, CPython runs the handler at its next check for pending signals (a function's start, a
loop's back edge, the return of a call into C), so a sample lands where the interpreter next
looked, not always where the CPU went: in a simulation driven by a compiled event loop
(``bench/sim/_simloop.c`` calling back into the replicas' Python), ~10 % of the samples fell on
the line of a C call (``observe_decode_run``) that ``perf record`` puts under 0.3 % of the
process. Where compiled code is involved, ``perf record`` tells which C functions the time is
really in. And the kernel delivers the timer's signal on its scheduler tick, so the interval is
at least one tick (4.2 ms measured on this box) whatever ``--interval`` asks: the program's end
prints how many samples its CPU time gave.
"""
from __future__ import annotations

import argparse
import atexit
import collections
import re
import runpy
import signal
import sys
import time
from types import FrameType

_LINE = re.compile(r":\d+\)$")


def _record(stacks: collections.Counter, frame: FrameType | None) -> None:
    parts = []
    while frame is not None:
        code = frame.f_code
        parts.append(f"{code.co_name} ({code.co_filename}:{frame.f_lineno})")
        frame = frame.f_back
    stacks[";".join(reversed(parts))] += 1


def sample(out: str, interval: float, argv: list[str]) -> None:
    """Run ``argv`` (``-m module ...`` or ``script ...``) in this process, sampling its stacks."""
    stacks: collections.Counter = collections.Counter()

    def dump() -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        with open(out, "w", encoding="utf-8") as fh:
            for stack, count in stacks.items():
                fh.write(f"{stack} {count}\n")
        cpu, taken = time.process_time(), sum(stacks.values())
        # (the interval asked for is a floor: the kernel fires the timer on its tick)
        print(f"cpu_sample: {taken} samples in {cpu:.2f} s of CPU: one every "
              f"{1000 * cpu / max(taken, 1):.1f} ms (asked: {1000 * interval:.1f} ms)", file=sys.stderr)

    atexit.register(dump)
    signal.signal(signal.SIGPROF, lambda _sig, frame: _record(stacks, frame))
    signal.setitimer(signal.ITIMER_PROF, interval, interval)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def shares(path: str) -> tuple[int, collections.Counter, collections.Counter]:
    """(samples, by function itself, by function with its callees) of a stacks file; a function
    is ``name (file)`` (its lines pooled), counted once per stack however deep it recurses."""
    own: collections.Counter = collections.Counter()
    within: collections.Counter = collections.Counter()
    total = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            n = int(count)
            total += n
            frames = [_LINE.sub(")", f) for f in stack.split(";")]
            own[frames[-1]] += n
            for frame in set(frames):
                within[frame] += n
    return total, own, within


def report(path: str, top: int) -> str:
    total, own, within = shares(path)
    lines = [f"{total} samples"]
    for title, counter in (("by itself", own), ("with its callees", within)):
        lines.append(f"== {title}")
        lines += [f"{100 * n / max(total, 1):5.1f}%  {frame}" for frame, n in counter.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    program: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, program = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the stacks here (with -- PROGRAM...)")
    parser.add_argument("--interval", type=float, default=0.0005, help="CPU seconds between samples")
    parser.add_argument("--report", metavar="STACKS", help="print the shares of a stacks file")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report, args.top))
        return 0
    if not args.out or not program or (program[0] == "-m" and len(program) < 2):
        parser.error("give --out FILE -- -m MODULE [ARGS...] (or -- SCRIPT [ARGS...]), or --report FILE")
    sample(args.out, args.interval, program)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
