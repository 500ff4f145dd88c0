"""WorkerConnections: the router's pooled HTTP clients to its workers, shared by the proxy and pre-warming.

The proxy's requests go through :meth:`WorkerConnections.post`: the router's own lean HTTP/1.1
client (``router/fleet/upstream.py``) for ``http://`` workers, aiohttp's session otherwise (and
for everything else: pre-warming).

Built with the rest of the router (no I/O), opened by ``router.context.start`` before anything
sends, closed last by ``stop``. Health probes keep a session of their own (their own, shorter
timeout; a probe must not wait behind a pool of streaming requests).
"""
from __future__ import annotations

from typing import Awaitable, Mapping

import aiohttp
from yarl import URL

from router.fleet.upstream import UpstreamPool, UpstreamResponse


class WorkerConnections:
    """The proxy's lean client (``lean``: for ``http://`` workers) and one ``aiohttp.ClientSession``
    to every worker: unlimited pooled connections, kept alive 75 s, bodies passed through
    undecoded; ``connect_timeout`` to connect, ``read_timeout`` between bytes."""

    MAX_URLS = 4096

    def __init__(self, connect_timeout: float, read_timeout: float, lean: bool = True) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        self._session: aiohttp.ClientSession | None = None
        self.upstream = UpstreamPool(connect_timeout, read_timeout, keepalive_s=75.0) if lean else None
        self._urls: dict[str, URL] = {}

    async def open(self) -> None:
        """Open the pooled session (on the running event loop)."""
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=75.0)
        # No cookie jar (workers set no cookies; filtering an empty jar still costs every request);
        # no Accept-Encoding (bodies pass through undecoded, and no Content-Encoding goes back to
        # the client) and no User-Agent: fewer headers built and parsed per request.
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=False,
                                              cookie_jar=aiohttp.DummyCookieJar(),
                                              skip_auto_headers=("Accept-Encoding", "User-Agent"))

    async def close(self) -> None:
        """Close the session and its pooled connections."""
        if self.upstream is not None:
            self.upstream.close()
        if self._session is not None:
            await self._session.close()

    def post(self, base: str, path: str, body: bytes,
             headers: Mapping[str, str]) -> "Awaitable[UpstreamResponse | aiohttp.ClientResponse]":
        """POST ``body`` to ``base + path``: awaited, the answer once its headers are in (read its
        body with ``content.readany()``, then ``release()`` or ``close()`` it). (The client's own
        awaitable, not a coroutine around it: one coroutine less a request.)"""
        if self.upstream is not None and self.upstream.handles(base):
            return self.upstream.post(base, path, body, headers)
        return self.session.post(self.url(base, path), data=body, headers=headers)

    def url(self, base: str, path: str) -> URL:
        """``base + path`` parsed once (aiohttp parses a string URL on every request)."""
        key = base + path
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) >= self.MAX_URLS:  # workers come and go (Kubernetes): never unbounded
                self._urls.clear()
            url = self._urls[key] = URL(key)
        return url

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open session (only between :meth:`open` and :meth:`close`)."""
        assert self._session is not None, "WorkerConnections.open() has not run"
        return self._session
