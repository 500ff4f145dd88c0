"""The installed prefixlb's version (``prefixlb --version``, ``GET /version``, ``prefixlb_router_build_info``)."""
from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def version() -> str:
    """The distribution's version, or ``0+unknown`` when run from a tree that was never installed."""
    try:
        return metadata.version("prefixlb")
    except metadata.PackageNotFoundError:
        return "0+unknown"
