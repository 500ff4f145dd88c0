"""WorkerConnections: the router's pooled HTTP client to its workers, shared by the proxy and pre-warming.

Built with the rest of the router (no I/O), opened by ``router.context.start`` before anything
sends, closed last by ``stop``. Health probes keep a session of their own (their own, shorter
timeout; a probe must not wait behind a pool of streaming requests).
"""
from __future__ import annotations

import aiohttp


class WorkerConnections:
    """One ``aiohttp.ClientSession`` to every worker: unlimited pooled connections, kept alive 75 s,
    bodies passed through undecoded; ``connect_timeout`` to connect, ``read_timeout`` between bytes."""

    def __init__(self, connect_timeout: float, read_timeout: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Open the pooled session (on the running event loop)."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=75.0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=False)

    async def close(self) -> None:
        """Close the session and its pooled connections."""
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open session (only between :meth:`open` and :meth:`close`)."""
        assert self._session is not None, "WorkerConnections.open() has not run"
        return self._session
