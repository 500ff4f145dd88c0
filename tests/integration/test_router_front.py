"""The router's fast front (router/http/front.py): plain inference requests are read by it, every
other request hands its connection to aiohttp with no byte lost, and both answer alike.

Raw sockets on loopback, so that the exact bytes (split heads and bodies, pipelining, chunked
bodies, malformed framing) are the test's to choose."""
from __future__ import annotations

import asyncio
import gzip
import json
import sys

import aiohttp
import pytest

from tests.integration.router_harness import running_router, scripted_workers, wait_until

BODY = {"model": "m", "prompt": "hello there, a prompt long enough to hash", "max_tokens": 2}


def post(path: str, body: dict | bytes, *extra: str, length: int | None = None) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: router", "Content-Type: application/json",
            f"Content-Length: {len(data) if length is None else length}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lower-case names), body (chunked or not)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


@pytest.fixture
async def router():
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url) as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 1, what="the worker routable")
        host, port = url.removeprefix("http://").split(":")
        yield ctx, worker, host, int(port)


async def test_plain_requests_take_the_fast_path_and_answer_as_aiohttp_does(router):
    ctx, worker, host, port = router
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(post("/v1/completions", BODY))
    fast = await read_response(reader)
    assert ctx.front.requests == 1 and ctx.front.handed_over == 0
    # the same request on a connection aiohttp serves (its first request is not a fast one)
    r2, w2 = await asyncio.open_connection(host, port)
    w2.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n" + post("/v1/completions", BODY))
    assert (await read_response(r2))[0] == 200
    slow = await read_response(r2)
    assert ctx.front.handed_over == 1 and ctx.front.requests == 1
    assert fast[0] == slow[0] == 200
    assert json.loads(fast[2]) == json.loads(slow[2])
    drop = {"date", "x-request-id"}  # per request
    assert {k: v for k, v in fast[1].items() if k not in drop} == {k: v for k, v in slow[1].items() if k not in drop}
    for w in (writer, w2):
        w.close()


async def test_a_keep_alive_connection_serves_fast_requests_then_hands_over_at_a_request_boundary(router):
    ctx, worker, host, port = router
    reader, writer = await asyncio.open_connection(host, port)
    for _ in range(3):
        writer.write(post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        status, headers, body = await read_response(reader)
        assert status == 200 and json.loads(body)["choices"]
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["data"][0]["id"] == "m"
    writer.write(post("/v1/completions", BODY))  # aiohttp's connection now: still answered
    assert (await read_response(reader))[0] == 200
    assert ctx.front.requests == 3 and ctx.front.handed_over == 1
    writer.close()


def _connection_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "FrontProtocol._run"]


async def test_a_connection_s_requests_one_after_another_are_served_by_one_task_that_ends_with_it(router):
    # one task a connection, not one a request (issue 18); idle between requests, it must still
    # end when the client goes away or aiohttp takes the connection, or every connection leaks one
    ctx, worker, host, port = router
    reader, writer = await asyncio.open_connection(host, port)
    tasks = []
    for _ in range(3):
        writer.write(post("/v1/completions", BODY))
        assert (await read_response(reader))[0] == 200
        tasks.append(_connection_tasks())
    assert len(tasks[0]) == 1 and tasks[0] == tasks[1] == tasks[2]
    writer.close()
    await wait_until(lambda: not _connection_tasks(), what="the connection's task ended")

    reader, writer = await asyncio.open_connection(host, port)
    writer.write(post("/v1/completions", BODY))
    assert (await read_response(reader))[0] == 200
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n")  # aiohttp's from here
    assert (await read_response(reader))[0] == 200
    await wait_until(lambda: not _connection_tasks(), what="the handed-over connection's task ended")
    assert ctx.front.handed_over == 1
    writer.close()


async def test_pipelined_requests_are_answered_in_order(router):
    ctx, worker, host, port = router
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(post("/v1/completions", {**BODY, "max_tokens": 1}) + post("/v1/completions", {**BODY, "max_tokens": 2})
                 + b"GET /version HTTP/1.1\r\nHost: router\r\n\r\n")
    assert [(await read_response(reader))[0] for _ in range(3)] == [200, 200, 200]
    assert [b["max_tokens"] for b in worker.bodies] == [1, 2]
    assert ctx.front.requests == 2 and ctx.front.handed_over == 1
    writer.close()


@pytest.mark.parametrize("pause_s, fast", [(0.01, True), (0.3, False)])
async def test_a_body_after_its_head_is_fast_when_prompt_and_aiohttps_when_slow(router, pause_s, fast):
    ctx, worker, host, port = router
    reader, writer = await asyncio.open_connection(host, port)
    data = post("/v1/completions", BODY)
    cut = data.index(b"\r\n\r\n") + 10
    writer.write(data[:cut])
    await asyncio.sleep(pause_s)
    writer.write(data[cut:])
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["choices"]
    assert (ctx.front.requests, ctx.front.handed_over) == ((1, 0) if fast else (0, 1))
    writer.close()


async def test_unusual_framing_is_aiohttps_to_judge(router):
    ctx, worker, host, port = router
    data = json.dumps(BODY).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))
    cases = [
        (chunked, 200),  # a chunked body: aiohttp reads it, the router answers
        (post("/v1/completions", BODY, "Content-Length: 5"), 400),  # two lengths: malformed
        (post("/v1/completions", BODY, " folded: header"), 400),  # obs-fold
        (post("/v1/completions?x=1", BODY), 200),  # a query string: aiohttp's routing
        (post("/v1/embeddings", BODY), 404),
        (post("/v1/completions", b"{not json"), 400),  # fast, and refused as before
        (post("/v1/completions", BODY).replace(b"Host: router\r\n", b""), 400),  # no Host
        (post("/v1/completions", BODY, "Host: other"), 400),  # two Hosts
        (post("/v1/completions", BODY, "content-type: text/plain"), 400),  # two Content-Types
        (post("/v1/completions", gzip.compress(json.dumps(BODY).encode()), "Content-Encoding: gzip"), 200),
    ]
    for raw, expected in cases:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(raw)
        status, headers, body = await read_response(reader)
        assert status == expected, (raw[:60], status, body)
        assert json.loads(body) if status != 200 else True
        if status >= 400:
            assert "error" in json.loads(body)
        writer.close()
    assert ctx.front.requests == 1 and ctx.front.handed_over == 9


async def test_connection_close_is_honoured_and_errors_keep_the_connection(router):
    ctx, worker, host, port = router
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(post("/v1/completions", {"model": "m"}))  # no prompt: a 400, the connection stays
    status, _, body = await read_response(reader)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    writer.write(post("/v1/completions", BODY, "Connection: close"))
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
    assert ctx.front.requests == 2 and ctx.front.handed_over == 0


async def test_a_stream_through_the_fast_front_arrives_event_by_event(router):
    ctx, worker, host, port = router
    worker.mode = "gated"
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(post("/v1/completions", {**BODY, "stream": True}))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b"Transfer-Encoding: chunked" in head and b"text/event-stream" in head
    size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).strip(), 16)
    first = await reader.readexactly(size + 2)
    assert first.startswith(b"data: ") and b'"a"' in first  # before the worker has finished
    worker.gate.set()
    rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
    assert b"[DONE]" in rest
    writer.write(post("/v1/completions", BODY))  # the connection is kept
    assert (await read_response(reader))[0] == 200
    assert ctx.front.requests == 2
    writer.close()


async def test_the_openai_client_and_aiohttp_are_served_on_the_fast_path(router):
    ctx, worker, host, port = router
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0)
    try:
        for _ in range(3):
            out = await client.completions.create(model="m", prompt=BODY["prompt"], max_tokens=2)
            assert out.choices[0].text == "ok"
        stream = await client.completions.create(model="m", prompt=BODY["prompt"], max_tokens=2, stream=True)
        assert [c.choices[0].text async for c in stream if c.choices] == ["a", "b"]
    finally:
        await client.close()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{host}:{port}/v1/completions", json=BODY) as resp:
            assert resp.status == 200
    assert ctx.front.requests == 5 and ctx.front.handed_over == 0


def _count_loop_lookups(monkeypatch) -> list[str]:
    """The router's and protocol's calls of asyncio.get_running_loop (directly, or through
    asyncio.current_task): a getpid() system call each on CPython 3.11."""
    calls: list[str] = []
    original = asyncio.get_running_loop

    def counted():
        for depth in (1, 2):  # the caller, or the caller of asyncio.current_task
            code = sys._getframe(depth).f_code
            if "/router/" in code.co_filename or "/protocol/" in code.co_filename:
                calls.append(f"{code.co_filename}:{code.co_name}")
                break
        return original()

    monkeypatch.setattr(asyncio, "get_running_loop", counted)
    monkeypatch.setattr(asyncio.events, "get_running_loop", counted)
    return calls


async def test_a_connection_s_requests_do_not_ask_asyncio_for_the_loop(router, monkeypatch):
    # the fast front's connection and the upstream connections hold their loop, and a request
    # carries it (issue 18): no getpid() system call a request, whole answers and streams alike
    ctx, worker, host, port = router
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(post("/v1/completions", BODY))  # the connections made (each takes its loop once)
    assert (await read_response(reader))[0] == 200
    calls = _count_loop_lookups(monkeypatch)
    for stream in (False, True, False, True):
        writer.write(post("/v1/completions", {**BODY, "stream": stream}))
        status, _, body = await read_response(reader)
        assert status == 200 and (b"[DONE]" in body) == stream
    await asyncio.sleep(0)  # (the bookings' releases and access records, in the loop's next turn)
    assert ctx.front.requests == 5
    assert calls == []
    writer.close()


async def test_no_fast_front_serves_the_port_with_aiohttp_alone():
    async with scripted_workers("w1") as (worker,), \
            running_router("--worker", worker.url, "--no-fast-front") as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 1, what="the worker routable")
        assert ctx.front is None
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200 and (await resp.json())["choices"]


async def test_an_idle_connection_closes_keepalive_seconds_after_its_last_answer(router, monkeypatch):
    ctx, worker, host, port = router
    monkeypatch.setattr("router.http.front.KEEPALIVE_S", 0.4)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(host, port)
    opened = loop.time()
    await asyncio.sleep(0.25)
    writer.write(post("/v1/completions", BODY))  # before the first deadline: the idle time starts again
    assert (await read_response(reader))[0] == 200
    answered = loop.time()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
    closed = loop.time()
    assert closed - opened > 0.4 + 0.2  # not at the first deadline (the connection was busy since)
    assert 0.4 - 0.05 <= closed - answered < 0.4 + 1.0
    writer.close()
