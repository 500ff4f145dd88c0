"""``router/http/front.py``'s one task a connection, driven with a fake transport: requests that
come one after another share the task; a request that arrives while the idle task is being
cancelled is not lost (it gets a task of its own)."""
from __future__ import annotations

import asyncio
import json

from router.http.fast_head import HeadShapes
from router.http.front import FastResponse, FrontProtocol


class _Transport:
    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class _App:
    on_response_prepare: list = []


class _Front:
    def __init__(self) -> None:
        self.app = _App()
        self.connections: set = set()
        self.requests = 0
        self.handed_over = 0
        self.tasks: list[asyncio.Task | None] = []

        async def handler(request: object) -> FastResponse:
            self.tasks.append(asyncio.current_task())
            return FastResponse(b"{}", 200, {"Content-Type": "application/json"})

        self.handlers = {"/v1/completions": handler}
        self.heads = HeadShapes(self.handlers)


def _request() -> bytes:
    body = json.dumps({"model": "m", "prompt": "p"}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_requests_one_after_another_share_the_connection_s_task():
    front, transport = _Front(), _Transport()
    conn = FrontProtocol(front)  # type: ignore[arg-type]
    conn.connection_made(transport)  # type: ignore[arg-type]
    for _ in range(3):
        conn.data_received(_request())
        await _settle()
    assert transport.out.count(b"HTTP/1.1 200 OK\r\n") == 3
    assert len(set(front.tasks)) == 1
    conn.connection_lost(None)
    await _settle()
    assert front.tasks[0].done()


async def test_a_request_arriving_as_the_idle_task_is_cancelled_gets_a_task_of_its_own():
    front, transport = _Front(), _Transport()
    conn = FrontProtocol(front)  # type: ignore[arg-type]
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(_request())
    await _settle()
    first = front.tasks[0]
    first.cancel()  # (a cancellation left pending by a handler, delivered while idle)
    conn.data_received(_request())  # before the cancelled task has run again
    await _settle()
    assert transport.out.count(b"HTTP/1.1 200 OK\r\n") == 2
    assert first.cancelled() and front.tasks[1] is not first
    conn.connection_lost(None)
