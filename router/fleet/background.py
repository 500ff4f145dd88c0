"""Per-worker background loops (probes, KV-event subscriptions): stopping them all at once."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait until each has ended, whatever it raised."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
