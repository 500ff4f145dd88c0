"""The compiled inner loops of a routing decision, where they were built (``_hotloop.c``).

``hot`` is the C module, bound to this checkout's :class:`~router.routing.policy.Candidate` and
:class:`~router.routing.load.WorkerLoad` layouts (and the LoadBoard's refresh of a worker's cached
rate, slot wait and limit flag, made its ``refresh``; and the PrefixIndex's match of a prefix more
workers hold than a decision scores, ``match_many``), or ``None``:
not built (no C compiler when the package was installed; ``setup.py`` makes the extension optional),
built for another layout, or turned off with ``PREFIXLB_PURE_PYTHON=1``. With ``None`` the
Balancer's candidate set and ``cache_aware`` run their Python loops; the decisions are the same
either way (the same float expressions in the same order, compared on random fleets in
tests/unit/test_hotloop.py), and a value the C loops were not written for (a field that is not an
exact float or int, a zero rate) makes them answer ``NotImplemented`` so that the Python loop gives
Python's answer or error.
"""
from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

from router.routing import load as load_module
from router.routing.load import WorkerLoad
from router.routing.policy import NOT_ON_RING, Candidate

LAYOUT_VERSION = 8  # the C module's LAYOUT_VERSION this code calls it with
PURE_PYTHON_ENV = "PREFIXLB_PURE_PYTHON"


def pure_python_requested() -> bool:
    """``PREFIXLB_PURE_PYTHON`` is set (not empty, 0, false or no): every optional C extension
    (this one, ``router/fleet/_wire.c``, ``bench/sim/_simloop.c``) stays unloaded."""
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() not in ("", "0", "false", "no")


def optional_extension(name: str) -> ModuleType | None:
    """The optional C extension module ``name``, or None: not built (no compiler at install) or
    turned off (:func:`pure_python_requested`)."""
    if pure_python_requested():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load() -> ModuleType | None:
    """The bound C module, or None (see the module docstring)."""
    _hotloop = optional_extension("router.routing._hotloop")
    if _hotloop is None:
        return None
    if getattr(_hotloop, "LAYOUT_VERSION", None) != LAYOUT_VERSION:
        warnings.warn(f"router/routing/_hotloop was built from another version of its source "
                      f"(layout {getattr(_hotloop, 'LAYOUT_VERSION', None)}, expected {LAYOUT_VERSION}): "
                      "using the Python loops; reinstall (make install) to rebuild it", RuntimeWarning)
        return None
    try:
        _hotloop.bind(Candidate, WorkerLoad, NOT_ON_RING)
    except (RuntimeError, TypeError) as exc:  # bound to other types already (a module reloaded), or a layout it cannot read
        warnings.warn(f"router/routing/_hotloop cannot be used here ({exc}): using the Python loops", RuntimeWarning)
        return None
    _hotloop.bind_refresh(load_module.refresh_python)
    return _hotloop


hot: ModuleType | None = load()
if hot is not None:
    # The LoadBoard refreshes a worker's cached figures millions of times a simulated run: its
    # module-level refresh becomes the C one (which hands anything unusual to the Python one).
    load_module._refresh = hot.refresh
