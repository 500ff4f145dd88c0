"""The floor of a Python router: ``python -m bench.peers.floor --port P WORKER_URL...``.

A proxy in plain asyncio protocols on uvloop that does only what every router must: read a
request (head and ``Content-Length`` body), pick a worker (round-robin), send the request as it
came over a pooled keep-alive connection, and relay the answer's bytes to the client as they
arrive (``Content-Length`` or chunked). No validation, JSON, routing state, metrics, logs,
retries or limits. ``bench/router_overhead.py --peers --routers ...,python-floor`` measures it
beside the routers: the CPU and latency no Python router on this event loop can go below, so
the rest of a router's cost is its own work.

It trusts its clients and workers (a benchmark tool on loopback, never a server to expose).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
from typing import Sequence
from urllib.parse import urlsplit

import uvloop

HEAD_END = b"\r\n\r\n"


def _content_length(head: bytes) -> int | None:
    """The ``Content-Length`` of a message head, or None when it has none."""
    at = head.lower().find(b"\r\ncontent-length:")
    if at < 0:
        return None
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17:end if end >= 0 else len(head)])


class _Answer:
    """Where a message's body ends, fed its bytes as they arrive (``Content-Length`` or chunked)."""

    def __init__(self, head: bytes) -> None:
        self.left = _content_length(head)
        self.chunked = self.left is None and b"chunked" in head.lower()
        self.pending = b""  # chunked: bytes not yet framed
        self.done = not self.chunked and not self.left

    def feed(self, data: bytes) -> int:
        """How many bytes of ``data`` belong to this message (``done`` once it is whole)."""
        if not self.chunked:
            used = min(len(data), self.left or 0)
            self.left = (self.left or 0) - used
            self.done = self.left == 0
            return used
        buf = self.pending + data
        start = len(self.pending)
        at = 0
        while True:
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                break
            size = int(buf[at:eol].split(b";", 1)[0], 16)
            end = eol + 2 + size + 2  # the chunk, then its CRLF
            if size == 0:  # the last chunk: then trailers (none here) and an empty line
                end = buf.find(HEAD_END, eol)
                if end < 0:
                    break
                self.done, self.pending = True, b""
                return end + 4 - start
            if len(buf) < end:
                break
            at = end
        self.pending = buf[at:]
        return len(data)


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to a worker; relays one answer at a time to ``client``."""

    def __init__(self, pool: list) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: "_Front | None" = None
        self.buffer = b""
        self.answer: _Answer | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.client is not None:
            self.client.upstream_lost()

    def data_received(self, data: bytes) -> None:
        if self.answer is None:
            self.buffer += data
            end = self.buffer.find(HEAD_END)
            if end < 0:
                return
            head, data = self.buffer[:end + 4], self.buffer[end + 4:]
            self.buffer = b""
            self.answer = _Answer(head)
            if self.answer.done:
                self._relay(head)
                self._finish()
                return
            used = self.answer.feed(data)
            self._relay(head + data[:used])
        else:
            used = self.answer.feed(data)
            self._relay(data[:used])
        if self.answer.done:
            self._finish()

    def _relay(self, data: bytes) -> None:
        if self.client is not None and data:
            self.client.transport.write(data)  # type: ignore[union-attr]

    def _finish(self) -> None:
        client, self.client, self.answer = self.client, None, None
        self.pool.append(self)
        if client is not None:
            client.answered()


class _Front(asyncio.Protocol):
    """One client connection: requests served one after another (pipelined ones wait their turn)."""

    def __init__(self, floor: "Floor") -> None:
        self.floor = floor
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        end = self.buffer.find(HEAD_END)
        if end < 0:
            return
        size = end + 4 + (_content_length(self.buffer[:end + 2]) or 0)
        if len(self.buffer) < size:
            return
        request, self.buffer = self.buffer[:size], self.buffer[size:]
        self.busy = True
        self.floor.send(self, request)

    def answered(self) -> None:
        self.busy = False
        self._next()

    def upstream_lost(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Floor:
    """The workers' connection pools and the round-robin."""

    def __init__(self, workers: Sequence[str]) -> None:
        self.addresses = [(u.hostname or "127.0.0.1", u.port or 80) for u in map(urlsplit, workers)]
        self.pools: dict[tuple[str, int], list[_Upstream]] = {a: [] for a in self.addresses}
        self.turn = itertools.cycle(self.addresses)

    def send(self, client: _Front, request: bytes) -> None:
        address = next(self.turn)
        pool = self.pools[address]
        while pool:
            upstream = pool.pop()
            if not upstream.lost:
                upstream.client = client
                upstream.transport.write(request)  # type: ignore[union-attr]
                return
        asyncio.get_running_loop().create_task(self._connect(address, client, request))

    async def _connect(self, address: tuple[str, int], client: _Front, request: bytes) -> None:
        pool = self.pools[address]
        _, upstream = await asyncio.get_running_loop().create_connection(lambda: _Upstream(pool), *address)
        upstream.client = client
        upstream.transport.write(request)  # type: ignore[union-attr]


async def serve(host: str, port: int, workers: Sequence[str]) -> None:
    """Serve until cancelled."""
    floor = Floor(workers)
    server = await asyncio.get_running_loop().create_server(lambda: _Front(floor), host, port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("workers", nargs="+", help="worker base URLs (http://host:port)")
    args = parser.parse_args(argv)
    try:
        uvloop.run(serve(args.host, args.port, args.workers))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
