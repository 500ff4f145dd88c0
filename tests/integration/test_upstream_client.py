"""The proxy's own HTTP/1.1 client (``router/fleet/upstream.py``) against scripted loopback servers:
every framing a worker may use, split at every byte; keep-alive reuse only after a complete
answer; and each way an answer can go wrong raising the exception (and so the failure kind)
aiohttp's client raised."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from router.fleet.health import refused
from router.fleet.upstream import _DONE, HIGH_WATER, REUSE_RACE_S, UpstreamPool, UpstreamProtocolError
from router.http.proxy import release_after_end
from tests.integration.router_harness import wait_until
from tests.support import completions_server, free_port

CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"f\r\ndata: {\"a\":1}\n\n\r\n"
           b"11;ext=1\r\ndata: [DONE]\n\n...\r\n"
           b"0\r\nX-Trailer: t\r\n\r\n")
CHUNKED_BODY = b"data: {\"a\":1}\n\ndata: [DONE]\n\n..."


class LoopbackServer:
    """A raw loopback HTTP server whose ``_serve`` each subclass writes; ``async with`` gives its URL."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    @staticmethod
    async def read_request(reader: asyncio.StreamReader) -> bytes:
        """One request (head and Content-Length body)."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        return head + await reader.readexactly(length)


class Scripted(LoopbackServer):
    """A loopback server answering each request on a connection with the next scripted reply
    (bytes, written in ``pieces``), then doing ``after`` ("keep" the connection, "close" it, "hang")."""

    def __init__(self, replies: list[bytes], pieces: int = 1, after: str = "keep") -> None:
        super().__init__()
        self.replies = list(replies)
        self.pieces = pieces
        self.after = after
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                self.requests.append(await self.read_request(reader))
                reply = self.replies.pop(0)
                step = max(1, -(-len(reply) // self.pieces))
                for i in range(0, len(reply), step):
                    writer.write(reply[i:i + step])
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.after == "close":
                    break
            if self.after == "hang":
                await asyncio.sleep(30)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _body(pool: UpstreamPool, url: str, path: str = "/v1/completions") -> tuple[int, dict, bytes]:
    response = await pool.post(url, path, b'{"x":1}', {"Content-Type": "application/json"})
    body = await response.content.read()
    response.release()
    return response.status, dict(response.headers), body


@pytest.mark.parametrize("pieces", [1, 3, len(CHUNKED)])
async def test_chunked_answers_are_decoded_whatever_the_reads_they_arrive_in(pieces):
    async with Scripted([CHUNKED], pieces=pieces) as url:
        pool = UpstreamPool(1.0, 5.0)
        status, headers, body = await _body(pool, url)
    assert (status, headers["Content-Type"], body) == (200, "text/event-stream", CHUNKED_BODY)


async def test_a_path_prefix_of_the_worker_url_goes_before_the_path():
    scripted = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"])
    async with scripted as url:
        assert (await _body(UpstreamPool(1.0, 5.0), url + "/prefix", "/v1/chat/completions"))[2] == b"{}"
    assert scripted.requests[0].startswith(b"POST /prefix/v1/chat/completions HTTP/1.1\r\n")


async def test_a_connection_is_reused_after_a_complete_answer_and_not_after_connection_close():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    closing = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    scripted = Scripted([ok, ok, closing, ok])
    async with scripted as url:
        pool = UpstreamPool(1.0, 5.0)
        for _ in range(3):
            assert (await _body(pool, url))[2] == b"{}"
        assert scripted.connections == 1
        scripted.replies = [ok]
        assert (await _body(pool, url))[2] == b"{}"
        assert scripted.connections == 2
    first = scripted.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Type: application/json\r\n" in first and b"\r\nContent-Length: 7\r\n" in first
    assert first.endswith(b'\r\n\r\n{"x":1}')


class ClosesWhenReused(LoopbackServer):
    """Answers the first request on each connection, then closes it when the next one comes,
    without a byte: a worker ending an idle keep-alive connection as the router reuses it."""

    def __init__(self, partial: bytes = b"", close_after_s: float = 0.0) -> None:
        super().__init__()
        self.partial = partial  # sent before closing, instead of nothing
        self.close_after_s = close_after_s  # how long it "works" on the second request before closing
        self.requests = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for answer in (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", self.partial):
                await self.read_request(reader)
                self.requests += 1
                if answer is self.partial:
                    await asyncio.sleep(self.close_after_s)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_reused_connection_closed_before_a_byte_of_answer_is_tried_again_on_a_new_one():
    server = ClosesWhenReused()
    async with server as url:
        pool = UpstreamPool(1.0, 5.0)
        for _ in range(3):  # each second request meets the close, and goes out again
            assert await _body(pool, url) == (200, {"Content-Length": "2"}, b"{}")
        assert server.connections == 3 and pool.stale_retries == 2


async def test_a_new_connection_or_a_partial_answer_closed_is_not_tried_again():
    for server in (ClosesWhenReused(partial=b"HTTP/1.1 200"),  # some of an answer: the worker read it
                   ClosesWhenReused(close_after_s=REUSE_RACE_S * 3)):  # it read it, worked, then failed
        async with server as url:
            pool = UpstreamPool(1.0, 5.0)
            await _body(pool, url)
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await _body(pool, url)
            assert server.requests == 2 and pool.stale_retries == 0  # sent once
    async with Scripted([b""], after="close") as url:  # a new connection: nothing to blame on reuse
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await UpstreamPool(1.0, 5.0).post(url, "/v1/completions", b"{}", {})


async def test_an_answer_without_framing_is_read_to_the_end_of_the_connection():
    async with Scripted([b"HTTP/1.0 200 OK\r\n\r\nall of it"], after="close") as url:
        pool = UpstreamPool(1.0, 5.0)
        assert await _body(pool, url) == (200, {}, b"all of it")


async def test_an_interim_100_answer_is_skipped():
    async with Scripted([b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\nContent-Length: 3\r\n\r\nbye"]) as url:
        pool = UpstreamPool(1.0, 5.0)
        assert await _body(pool, url) == (503, {"Content-Length": "3"}, b"bye")


async def test_a_body_cut_short_is_a_payload_error_and_no_answer_a_disconnect():
    async with Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"], after="close") as url:
        pool = UpstreamPool(1.0, 5.0)
        response = await pool.post(url, "/v1/completions", b"{}", {})
        assert await response.content.readany() == b"short"
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.content.readany()
        response.close()
    async with Scripted([b""], after="close") as url:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await UpstreamPool(1.0, 5.0).post(url, "/v1/completions", b"{}", {})


@pytest.mark.parametrize("reply", [b"SMTP ready\r\n\r\n", b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
                                   b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
                                   b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"])
async def test_an_answer_that_is_not_http_is_a_client_error(reply):
    async with Scripted([reply], after="hang") as url:
        with pytest.raises(UpstreamProtocolError) as info:
            await UpstreamPool(1.0, 5.0).post(url, "/v1/completions", b"{}", {})
    assert isinstance(info.value, aiohttp.ClientError)


async def test_a_bad_chunk_fails_the_read_not_the_headers():
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n"
    async with Scripted([reply], after="hang") as url:
        response = await UpstreamPool(1.0, 5.0).post(url, "/v1/completions", b"{}", {})
        assert response.status == 200
        with pytest.raises(UpstreamProtocolError):
            await response.content.readany()
        response.close()


async def test_silence_longer_than_the_read_timeout_is_a_timeout():
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n"
    async with Scripted([reply], after="hang") as url:
        response = await UpstreamPool(1.0, 0.2).post(url, "/v1/completions", b"{}", {})
        assert await response.content.readany() == b"hi"
        with pytest.raises(TimeoutError) as info:
            await response.content.readany()
        response.close()
    assert isinstance(info.value, aiohttp.ServerTimeoutError)
    async with Scripted([b""], after="hang") as url:  # no answer at all
        with pytest.raises(TimeoutError):
            await UpstreamPool(1.0, 0.2).post(url, "/v1/completions", b"{}", {})


async def test_a_refused_connection_is_refused():
    with pytest.raises(OSError) as info:
        await UpstreamPool(1.0, 1.0).post(f"http://127.0.0.1:{free_port()}", "/v1/completions", b"{}", {})
    assert refused(info.value)


async def test_closing_an_answer_early_drops_its_connection_and_a_new_one_is_made():
    big = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (4 * HIGH_WATER) + b"x" * (4 * HIGH_WATER)
    scripted = Scripted([big, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"], pieces=64)
    async with scripted as url:
        pool = UpstreamPool(1.0, 5.0)
        response = await pool.post(url, "/v1/completions", b"{}", {})
        first = await response.content.readany()
        assert 0 < len(first) <= 4 * HIGH_WATER
        response.close()
        assert (await _body(pool, url))[2] == b"{}"
    assert scripted.connections == 2


async def test_a_large_body_arrives_whole_through_paused_and_resumed_reads():
    payload = bytes(range(256)) * (3 * HIGH_WATER // 256)
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    async with Scripted([reply], pieces=200) as url:
        pool = UpstreamPool(1.0, 5.0)
        response = await pool.post(url, "/v1/completions", b"{}", {})
        deadline = asyncio.get_running_loop().time() + 10
        while not response._paused:  # the server fills the buffer past the high-water mark
            assert asyncio.get_running_loop().time() < deadline, "reading was never paused"
            await asyncio.sleep(0.01)
        assert await response.content.read() == payload
        response.release()


async def test_idle_connections_past_the_keepalive_are_closed_and_their_worker_forgotten():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    scripted = Scripted([ok, ok])
    async with scripted as url:
        pool = UpstreamPool(1.0, 5.0, keepalive_s=0.0)
        assert (await _body(pool, url))[2] == b"{}"  # released after the keepalive: swept at once
        assert pool._idle == {}
        assert (await _body(pool, url))[2] == b"{}"
    assert scripted.connections == 2


async def test_a_header_with_a_newline_is_refused_before_anything_is_sent():
    scripted = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"])
    async with scripted as url:
        with pytest.raises(ValueError):
            await UpstreamPool(1.0, 5.0).post(url, "/v1/completions", b"{}", {"X-Evil": "a\r\nX-Injected: 1"})
    assert scripted.requests == []


async def test_a_host_whose_every_address_refuses_is_refused(monkeypatch):
    # asyncio folds one refusal per address of a name (localhost: ::1 and 127.0.0.1) into an
    # OSError("Multiple exceptions: ..."); the breaker must still see a refused connection
    loop = asyncio.get_running_loop()

    async def every_address_refuses(*args, **kwargs):
        raise OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 9, 0, 0), "
                      "[Errno 111] Connect call failed ('127.0.0.1', 9)")

    monkeypatch.setattr(loop, "create_connection", every_address_refuses)
    with pytest.raises(ConnectionRefusedError) as info:
        await UpstreamPool(1.0, 1.0).post("http://localhost:9", "/v1/completions", b"{}", {})
    assert refused(info.value)

    async def one_address_times_out(*args, **kwargs):
        raise OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 9, 0, 0), "
                      "[Errno 113] No route to host")

    monkeypatch.setattr(loop, "create_connection", one_address_times_out)
    with pytest.raises(OSError) as other:
        await UpstreamPool(1.0, 1.0).post("http://localhost:9", "/v1/completions", b"{}", {})
    assert not refused(other.value)


class EndsLate(LoopbackServer):
    """Answers each request with a chunked stream whose last event is ``data: [DONE]``, and sends
    the body's end (``0\\r\\n\\r\\n``) ``end_after_s`` later, or never (None)."""

    def __init__(self, end_after_s: float | None) -> None:
        super().__init__()
        self.end_after_s = end_after_s

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await self.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\ne\r\ndata: [DONE]\n\n\r\n")
                await writer.drain()
                if self.end_after_s is None:
                    await reader.read()  # until the router drops the connection
                    return
                await asyncio.sleep(self.end_after_s)
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("end_after_s, connections", [(0.05, 1), (None, 2)])
async def test_a_stream_released_at_its_done_event_is_pooled_when_its_end_follows(end_after_s, connections):
    server = EndsLate(end_after_s)
    async with server as url:
        pool = UpstreamPool(1.0, 5.0)
        for _ in range(2):
            response = await pool.post(url, "/v1/completions", b"{}", {})
            assert await response.content.readany() == b"data: [DONE]\n\n"
            response.release_after_end(grace_s=5.0 if end_after_s is not None else 0.3)
            await wait_until(lambda: response._finished, what="the answer's end, or the grace over")
        assert server.connections == connections


@pytest.mark.parametrize("end_after_s, connections", [(0.05, 1), (None, 2)])
async def test_an_aiohttp_stream_released_at_its_done_event_is_pooled_when_its_end_follows(end_after_s, connections):
    """The same for ``https://`` workers, whose answers are aiohttp's (router/http/proxy.py)."""
    peers: set = set()
    ended = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        if end_after_s is None:
            await ended.wait()
        else:
            await asyncio.sleep(end_after_s)
        await response.write_eof()
        return response

    async with completions_server(stream) as url, aiohttp.ClientSession() as session:
        try:
            for _ in range(2):
                response = await session.post(url + "/v1/completions", data=b"{}")
                assert await response.content.readany() == b"data: [DONE]\n\n"
                release_after_end(response, grace_s=5.0 if end_after_s is not None else 0.3)
                await wait_until(lambda: response.closed or response.connection is None, what="released or closed")
            assert len(peers) == connections
        finally:
            ended.set()


async def test_the_read_timeout_counts_from_the_last_bytes_on_a_reused_connection_too():
    """Silence is timed from each wait's start: bytes (or a new request on a pooled connection)
    before the deadline move it on, and the timeout comes read_timeout after the last of them."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # the first request, at once
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        await asyncio.sleep(0.3)  # the second: its head after 0.3 s, a chunk 0.3 s later, then silence
        writer.write(head)
        await asyncio.sleep(0.3)
        writer.write(b"2\r\nhi\r\n")
        await done.wait()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = UpstreamPool(1.0, 0.4)
    loop = asyncio.get_running_loop()
    try:
        first = await pool.post(url, "/v1/completions", b"{}", {})
        assert await first.content.read() == b"ok"
        first.release()
        await asyncio.sleep(0.2)  # the connection idles in the pool past part of the first wait's timeout
        second = await pool.post(url, "/v1/completions", b"{}", {})
        assert await second.content.readany() == b"hi"
        got = loop.time()
        with pytest.raises(aiohttp.ServerTimeoutError):
            await second.content.readany()
        assert 0.4 - 0.05 <= loop.time() - got < 0.4 + 1.0
        second.close()
    finally:
        done.set()
        pool.close()
        server.close()


async def test_a_body_taken_without_waiting_is_the_whole_body_once_it_is_all_in_and_within_its_limit():
    payload = bytes(range(256)) * 40
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    async with Scripted([reply, reply], pieces=4) as url:
        pool = UpstreamPool(1.0, 5.0)
        response = await pool.post(url, "/v1/completions", b"{}", {})
        if response._state != _DONE:  # the head is in, the body still coming (4 writes)
            assert response.body_nowait(1 << 20) is None
        await wait_until(lambda: response._state == _DONE)
        assert response.body_nowait(len(payload) - 1) is None  # over the limit: nothing taken
        assert response.body_nowait(len(payload)) == payload
        assert await response.content.read() == b""  # taken: the body's end, as after reading it
        response.release()
        again = await pool.post(url, "/v1/completions", b"{}", {})  # the connection went back to the pool
        assert await again.content.read() == payload
        again.release()
    assert pool.stale_retries == 0
