"""Which event loop the servers run on: uvloop when installed (a dependency on Linux), else asyncio.

``PREFIXLB_EVENT_LOOP=asyncio`` forces the standard loop (for comparisons, or to rule uvloop out
when debugging); ``uvloop`` requires it.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")
ENV = "PREFIXLB_EVENT_LOOP"


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what :func:`run` will use."""
    wanted = os.environ.get(ENV, "auto").strip().lower()
    if wanted not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{ENV} must be auto, uvloop or asyncio, not {wanted!r}")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if wanted == "uvloop":
            raise
        return "asyncio"
    return "uvloop"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on the loop :func:`loop_name` names (uvloop: ~a third less CPU per
    proxied request than the standard loop on the router; see docs/benchmarks.md)."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)
