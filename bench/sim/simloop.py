"""The simulator's innermost loops, compiled where they were built (``_simloop.c``), else Python.

The replicas call :func:`decode_run_time`, :func:`decode_run_cut`, :func:`decode_steps_done_by`
and :func:`observe_decode_run` from here: the C functions when ``bench/sim/_simloop`` was built
(``setup.py`` makes it optional) and ``PREFIXLB_PURE_PYTHON=1`` is not set, otherwise
:mod:`bench.sim.decode_run`'s. The results are the same either way (the same float expressions
in the same order, compared on random runs in tests/unit/test_simloop.py); an argument the C
functions were not written for (a step time term that is not an exact float, another argument
that is not an exact float or int, a NaN, a meter whose clipping could act) is handed to the
Python function, which gives Python's answer or error. So do the
:mod:`bench.sim.decode_heaps` readers (:func:`next_finish`, :func:`next_block_need`,
:func:`pop_finished`, :func:`pop_block_needs`): the same entries dropped, the same answers.

:data:`drain_events` is the body of the fleet's event loop (``bench.sim.fleet``), or None: the
fleet then runs its Python loop (the same events in the same order, compared run by run in
tests/unit/test_simloop.py). It stops before an event it was not written for (a time that is not
an exact float, a negative worker index...), which the Python loop then handles.
"""
from __future__ import annotations

from types import ModuleType

from router.routing.hotloop import optional_extension

from bench.sim import decode_heaps, decode_run

__all__ = ["compiled", "decode_run_cut", "decode_run_time", "decode_steps_done_by", "drain_events", "next_block_need",
           "next_finish", "observe_decode_run", "pop_block_needs", "pop_finished"]


def load() -> ModuleType | None:
    """The C module, bound to the Python functions it hands unusual arguments to; or None."""
    _simloop = optional_extension("bench.sim._simloop")
    if _simloop is None:
        return None
    _simloop.bind(decode_run.decode_run_time, decode_run._steps_done_by, decode_run.decode_steps_done_by,
                  decode_run.decode_run_cut, decode_run.observe_decode_run)
    return _simloop


compiled: ModuleType | None = load()

if compiled is not None:
    decode_run_time = compiled.decode_run_time
    decode_run_cut = compiled.decode_run_cut
    decode_steps_done_by = compiled.decode_steps_done_by
    observe_decode_run = compiled.observe_decode_run
    drain_events = compiled.drain_events
    next_finish, next_block_need = compiled.next_finish, compiled.next_block_need
    pop_finished, pop_block_needs = compiled.pop_finished, compiled.pop_block_needs
else:
    decode_run_time = decode_run.decode_run_time
    decode_run_cut = decode_run.decode_run_cut
    decode_steps_done_by = decode_run.decode_steps_done_by
    observe_decode_run = decode_run.observe_decode_run
    drain_events = None
    next_finish, next_block_need = decode_heaps.next_finish, decode_heaps.next_block_need
    pop_finished, pop_block_needs = decode_heaps.pop_finished, decode_heaps.pop_block_needs
