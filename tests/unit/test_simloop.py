"""The simulator's compiled loops (bench/sim/_simloop.c) answer exactly as the Python ones do.

The fleet's event loop: whole simulations -- delays on every path or none, heartbeats polled or read
at once, adapters read from disk (a delayed arrival the Python loop takes), the CPU KV tier -- run
with the compiled body and with the Python one and must give the same records and metadata. The
decoding requests' heaps: random heaps with stale entries read and popped by both must answer the
same and leave the same heaps. The decode runs' closed forms: random runs in both roofline regimes
and across their crossing (compute- and memory-bound first, parallel lines, runs of 1 to 10,000
steps, cuts at any elapsed time) go through both :mod:`bench.sim.decode_run` and the C module; every
time, cut and speed estimate must be the same float to the bit (compared as ``float.hex()``).
Arguments the C functions were not written for (ints, NaN, a meter whose clipping acts) must give
Python's answer or error too, and events the compiled loop was not written for (odd times, entries,
indexes, arguments; some run Python code that changes the heaps) are left to the Python loop.
"""
from __future__ import annotations

import math
import os
import random
import shutil
import sysconfig

import pytest

from router.routing.hotloop import PURE_PYTHON_ENV
from worker.engine.stats import SpeedMeter

from bench.sim import decode_heaps, decode_run, simloop
from bench.sim.fleet import FleetConfig, simulate
from bench.sim.router import SimRouterConfig
from bench.workloads import load_workload
from tests.support import run_isolated

C = simloop.compiled
needs_c = pytest.mark.skipif(C is None, reason="bench/sim/_simloop is not built (no compiler, or PREFIXLB_PURE_PYTHON)")


def _hex(value):
    """A result with its floats as ``float.hex()``: equal only when bit-identical."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, tuple):
        return tuple(_hex(v) for v in value)
    return value


def _random_run(rng: random.Random) -> tuple[float, float, float, float, float, int]:
    """``(overhead, c0, c1, m0, m1, k)`` of a decode run like a simulated replica's, or an edge of one."""
    shape = rng.random()
    oh = rng.choice([0.0, 1e-4, rng.uniform(0, 5e-3)])
    c0, m0 = rng.uniform(1e-4, 3e-2), rng.uniform(1e-4, 3e-2)
    c1, m1 = rng.uniform(0, 1e-5), rng.uniform(0, 1e-5)
    if shape < 0.15:
        m1 = c1  # parallel lines: one regime all along
    elif shape < 0.3:
        c0 = m0  # crossing at 0
    elif shape < 0.4:
        m1 = c1 * 0.999  # crossing far out
    k = rng.choice([1, 2, 3, rng.randint(1, 60), rng.randint(1, 10_000)])
    return oh, c0, c1, m0, m1, k


def test_the_c_module_is_built_wherever_a_compiler_is():
    """`make install` builds it (setup.py); a silent fallback would lose the speed unnoticed."""
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        pytest.skip("PREFIXLB_PURE_PYTHON is set")
    if not shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"):
        pytest.skip("no C compiler here: the Python functions are the build")
    assert C is not None
    assert simloop.decode_run_time is C.decode_run_time


def test_pure_python_env_turns_it_off(monkeypatch):
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    assert simloop.load() is None


@needs_c
def test_run_times_cuts_and_steps_done_are_bit_identical_on_random_runs():
    rng = random.Random(18)
    for _ in range(20_000):
        oh, c0, c1, m0, m1, k = run = _random_run(rng)
        assert _hex(C.decode_run_time(*run)) == _hex(decode_run.decode_run_time(*run))
        total = decode_run.decode_run_time(*run)
        for elapsed in (rng.uniform(0, total), rng.uniform(0, 1.2 * total), 0.0, total, -1e-3,
                        decode_run.decode_run_time(oh, c0, c1, m0, m1, rng.randint(0, k))):
            args = (elapsed, *run)
            assert _hex(C.steps_done_by(*args)) == _hex(decode_run._steps_done_by(*args)), args
            assert C.decode_steps_done_by(*args) == decode_run.decode_steps_done_by(*args), args
            assert _hex(C.decode_run_cut(*args)) == _hex(decode_run.decode_run_cut(*args)), args


@needs_c
def test_a_folded_run_leaves_the_meter_exactly_where_the_python_fold_does():
    rng = random.Random(7)
    for _ in range(20_000):
        oh, c0, c1, m0, m1, k = _random_run(rng)
        batch = rng.choice([0, 1, rng.randint(1, 256)])
        measured = rng.random() < 0.8
        start = rng.choice([c0 + oh, rng.uniform(1e-4, 5e-2), rng.uniform(1e-4, 1.0)])
        alpha = rng.choice([0.2, 0.05, 1.0, rng.random() or 0.5])
        max_jump = rng.choice([10.0, 10, 3.0])  # an int too: the engine's default is a float
        meters = []
        for fold in (C.observe_decode_run, decode_run.observe_decode_run):
            speed = SpeedMeter(5000.0, start, alpha=alpha, max_jump=max_jump)
            speed.decode_measured = measured
            fold(speed, oh, c0, c1, m0, m1, k, batch)
            meters.append((speed.decode_step_s.hex(), speed.decode_measured, speed.prefill_tokens_per_s))
        assert meters[0] == meters[1], (oh, c0, c1, m0, m1, k, batch, measured, start, alpha)


@needs_c
def test_arguments_the_c_functions_were_not_written_for_get_pythons_answer_or_error():
    # ints (exact in a double), a NaN crossing, an int past 2**53: the same answer or the same error
    cases = [(0, 1, 0, 2, 0, 5), (1e-3, 0.01, 1e-6, 0.02, 0.0, 2**60), (0.0, math.nan, 1.0, 0.0, 0.5, 4),
             (0.0, 1.0, math.inf, 0.0, 0.5, 4), (1e-3, 0.01, 1e-6, 0.02, 0.0, 7.0)]
    for run in cases:
        for c_fn, py_fn, args in ((C.decode_run_time, decode_run.decode_run_time, run),
                                  (C.decode_run_cut, decode_run.decode_run_cut, (0.05, *run)),
                                  (C.decode_steps_done_by, decode_run.decode_steps_done_by, (0.05, *run))):
            try:
                expected = ("ok", _hex(py_fn(*args)))
            except Exception as exc:  # noqa: BLE001 - the error itself is what must match
                expected = ("error", type(exc))
            try:
                got = ("ok", _hex(c_fn(*args)))
            except Exception as exc:  # noqa: BLE001
                got = ("error", type(exc))
            assert got == expected, (c_fn, args)


@needs_c
def test_a_meter_whose_clipping_acts_is_folded_step_by_step_as_in_python():
    # a run whose steps grow past max_jump x the estimate: the Python loop clips, and so must the C path
    for measured in (True, False):
        meters = []
        for fold in (C.observe_decode_run, decode_run.observe_decode_run):
            speed = SpeedMeter(5000.0, 1e-4, alpha=0.2, max_jump=2.0)
            speed.decode_measured = measured
            fold(speed, 0.0, 1e-3, 1e-3, 1e-3, 0.0, 50, 8)
            meters.append((speed.decode_step_s.hex(), speed.decode_measured))
        assert meters[0] == meters[1]


@needs_c
@pytest.mark.parametrize("workload, workers, router, extra", [
    ("system-prompt", 8, dict(report_poll_s=1.0, kv_event_delay_s=0.02, hop_s=0.0005), {}),
    ("multi-turn", 6, dict(report_poll_s=0.0, kv_event_delay_s=0.0, hop_s=0.0), {}),
    ("multi-turn", 6, dict(report_interval_s=0.0, kv_event_delay_s=0.01, hop_s=0.0), dict(cpu_kv_ratio=2.0)),
    ("multi-lora", 4, dict(report_poll_s=0.5, kv_event_delay_s=0.02, hop_s=0.0005), dict(max_loras=2)),
    ("conversation", 5, dict(report_poll_s=1.0, kv_event_delay_s=0.02, hop_s=0.0005), {}),
])
def test_the_compiled_event_loop_gives_the_same_simulation_as_the_python_loop(monkeypatch, workload, workers, router,
                                                                                extra):
    requests = load_workload(workload, seed=3, num_requests=500)
    cfg = FleetConfig(workers=workers, unit=64, kv_blocks=2000, router=SimRouterConfig(**router), **extra)
    compiled = simulate(requests, cfg)
    monkeypatch.setattr(simloop, "drain_events", None)
    pure = simulate(requests, cfg)
    assert compiled.records == pure.records
    assert {k: v for k, v in compiled.meta.items() if k != "wall_s"} == {k: v for k, v in pure.meta.items()
                                                                          if k != "wall_s"}
    assert sum(r.ok for r in pure.records) > 400  # (a conversation may outgrow the context: an error record)
    if workload == "multi-lora":
        assert pure.meta["lora"]["disk_loads"] > 0  # delayed arrivals, which the Python loop takes


class _Req:
    __slots__ = ("dseq", "blocks")

    def __init__(self, dseq: int, blocks: int) -> None:
        self.dseq, self.blocks = dseq, [None] * blocks


def _random_heaps(rng: random.Random) -> tuple[list, list]:
    """A decoding prefix's finish and block heaps, a third of their entries stale."""
    import heapq

    finish, block = [], []
    for dseq in range(1, rng.randint(1, 40)):
        req = _Req(dseq if rng.random() < 0.7 else -1, rng.randint(1, 5))
        tick = rng.randint(0, 30)
        heapq.heappush(finish, (tick, dseq, req))
        nblocks = len(req.blocks) if rng.random() < 0.7 else len(req.blocks) - 1
        heapq.heappush(block, (rng.randint(0, 30), dseq, nblocks, req))
    return finish, block


@needs_c
def test_the_decode_heaps_are_read_and_popped_alike():
    rng = random.Random(5)
    for _ in range(3000):
        seed = rng.random()
        results = []
        for impl in (C, decode_heaps):
            finish, block = _random_heaps(random.Random(seed))
            tick = random.Random(seed).randint(0, 30)
            out = []
            for read in (lambda: impl.next_finish(finish), lambda: impl.next_block_need(block)):
                try:
                    out.append(read())
                except IndexError:
                    out.append("empty")
            out.append([(r.dseq, len(r.blocks)) for r in impl.pop_finished(finish, tick)])
            out.append([(r.dseq, len(r.blocks)) for r in impl.pop_block_needs(block, tick)])
            out.append([(t, d) for t, d, _ in finish] + [(t, d, n) for t, d, n, _ in block])
            results.append(out)
        assert results[0] == results[1]


@needs_c
def test_int_step_terms_get_pythons_exact_int_arithmetic():
    """With int terms Python's sums and products are exact ints (overhead * k, c0 - m0): the C
    functions, which would round them as doubles, hand them over."""
    run = (-651965, 962499, -694441, -446747, -863393, 662850267753)
    assert C.decode_run_time(*run) == decode_run.decode_run_time(*run)
    for elapsed in (0.5, 10**6, 10**12):
        assert C.decode_run_cut(elapsed, *run) == decode_run.decode_run_cut(elapsed, *run)
        assert C.decode_steps_done_by(elapsed, *run) == decode_run.decode_steps_done_by(elapsed, *run)


@needs_c
def test_a_time_whose_conversion_empties_the_delayed_calls_is_left_to_the_python_loop():
    """A time that is not a float (its __float__ here empties the heap) stops the compiled loop
    before it reads anything: nothing handled, the heap as it was."""
    out = run_isolated("""
        import gc
        from bench.sim import simloop
        delayed = []
        class Time:
            def __float__(self):
                delayed.clear(); gc.collect(); return 0.0
        delayed.append((Time(), 1, print, ("r", 0.0)))
        inf = float("inf")
        print(simloop.compiled.drain_events([], delayed, [], 10.0, inf, 0, 0.0, 0.0, print, print, print), len(delayed))
    """)
    assert out == "None 1\n"


@needs_c
def test_delayed_call_arguments_that_are_not_a_tuple_are_left_to_the_python_loop():
    """Python's handler(*args) takes a list too; the compiled loop leaves such a call to it."""
    out = run_isolated("""
        from bench.sim import simloop
        calls = []
        def on_finish(*args): calls.append(args)
        delayed = [(0.0, 1, on_finish, ["r", 0.0])]
        inf = float("inf")
        print(simloop.compiled.drain_events([], delayed, [], 10.0, inf, 0, 0.0, 0.0, print, print, on_finish),
              len(delayed), calls)
    """)
    assert out == "None 1 []\n"


@needs_c
@pytest.mark.parametrize("entry", [(0.0, 1, -1, 0), [0.0, 1, 0, 0], (0, 1, 0, 0), (0.0, 1, 0.0, 0), (0.0, 1, 5, 0)],
                         ids=["negative-index", "list", "int-time", "float-index", "index-past-the-end"])
def test_an_event_the_compiled_loop_was_not_written_for_is_left_to_the_python_loop(entry):
    """workers[-1], a list entry, an int time...: the Python loop's own answer (or error), so the
    compiled one handles nothing and leaves the heap as it was."""
    heap = [entry]
    inf = float("inf")
    assert C.drain_events(heap, [], [object()], 10.0, inf, 0, 0.0, 0.0, print, print, print) is None
    assert heap == [entry]
