"""No answer a worker sends can hang the router, crash it, or reach the client as anything but a
well-formed answer: random, mostly broken HTTP answers to inference requests.

A raw loopback "worker" answers its health and model probes properly and each inference request
with bytes chosen by a seed in the request's prompt: status lines, header blocks, framings
(length, chunked, read to close), bodies (JSON, SSE, cut short, overlong, not UTF-8, absurd
usage), line endings, and what it does after (keep the connection, close it, fall silent). The
router in front of it (one attempt, a 1 s read timeout, a breaker that never opens, so every
case reaches the worker) must, for every case:

- answer within the read timeout and a margin, with a complete HTTP response;
- answer a status the client can act on: the worker's own 2xx/4xx, or 502/503/504 in OpenAI's
  error shape -- never a 500;
- end a committed stream with ``data: [DONE]`` (an SSE error event first if the worker failed);
- and afterwards still serve a good worker's request.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re

import aiohttp
import pytest

from tests.integration.router_harness import running_router, scripted_workers, wait_until

CASES = 240
FIRST_SEED = int(os.environ.get("PREFIXLB_WORKER_FUZZ_SEED", "0"))  # another run of cases: set it
READ_TIMEOUT_S = 1.0
ADMIN_TOKEN = "hostile-worker-test-token"
CASE = re.compile(rb'"prompt": ?"case (\d+)')

USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
ODD_USAGE = [{"prompt_tokens": "7"}, {"prompt_tokens": -1}, {"prompt_tokens": 1e308}, {"prompt_tokens": 10 ** 40},
             [], None, "usage", {"prompt_tokens_details": {"cached_tokens": "x"}}, {"prompt_tokens": True},
             {"prompt_tokens": 7, "prompt_tokens_details": []}, {"a": {"b": {"c": [[[[[]]]]]}}}]
STATUS_LINES = [b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 200", b"HTTP/1.1 201 Created",
                b"HTTP/1.1 500 Internal Server Error", b"HTTP/1.1 503 Busy", b"HTTP/1.1 429 Slow down",
                b"HTTP/1.1 400 Bad", b"HTTP/1.1 404 Nope", b"HTTP/1.1 2000 OK", b"HTTP/1.1 abc OK", b"HTTP/2 200",
                b"ICY 200 OK", b"", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK", b"HTTP/1.1 204 No Content",
                b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 301 Moved\r\nLocation: http://elsewhere/",
                b"HTTP/1.1 999 Odd", b"HTTP/1.1 -200 OK"]
ODD_HEADERS = [b"Content-Length: 5", b"Content-Length: -1", b"Content-Length: 99999999999999999999",
               b"Content-Length: abc", b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked",
               b"Transfer-Encoding: chunked, chunked", b"X-Nul: a\x00b", b"NoColon", b"X-Latin: caf\xe9",
               b"Content-Type: text/event-stream", b"Content-Type: application/json", b"Content-Encoding: gzip",
               b"Content-Encoding: br", b"X-Long: " + b"v" * 70000, b"Connection: close", b"Connection: keep-alive",
               b"X-Request-Id: \xff\xfe", b"X-Prefixlb-Worker-Id: someone-else", b"Set-Cookie: a=b",
               b": empty", b"X-Many: 1\r\n" * 300 + b"X-End: 1"]


def _json_answer(rng: random.Random) -> bytes:
    usage = rng.choice(ODD_USAGE) if rng.random() < 0.3 else USAGE
    body = {"id": "c", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}], "usage": usage}
    text = json.dumps(body).encode()
    roll = rng.random()
    if roll < 0.1:
        return text[:rng.randrange(len(text))]  # not JSON
    if roll < 0.15:
        return b"\xff\xfe" + text
    if roll < 0.2:
        return b"[" * 50000 + b"]" * 50000
    if roll < 0.23:
        return b'{"x": "' + b"a" * 3_000_000 + b'"}'
    return text


def _sse_answer(rng: random.Random) -> bytes:
    events = [b'data: {"choices": [{"index": 0, "text": "a"}], "usage": null}\n\n']
    for _ in range(rng.randint(0, 3)):
        events.append(rng.choice([
            b'data: {"choices": [{"index": 0, "text": "b"}], "usage": null}\n\n',
            b"data: {\n\n", b"data: \xff\xfe\n\n", b": comment\n\n", b"event: x\ndata: y\n\n",
            b'data: {"error": {"message": "worker says no"}}\n\n', b"data:" + b"z" * rng.choice([10, 2_000_000]) + b"\n\n",
            b'data: {"choices": [], "usage": ' + json.dumps(rng.choice(ODD_USAGE + [USAGE])).encode() + b"}\n\n",
            b"data: a\r\n\r\n", b"\n\n\n", b"data: [DONE]\n\n"]))
    if rng.random() < 0.7:
        events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def _chunked(body: bytes, rng: random.Random) -> bytes:
    out = b""
    i = 0
    while i < len(body):
        n = rng.randint(1, max(1, len(body) // 2))
        out += b"%x\r\n" % n + body[i:i + n] + b"\r\n"
        i += n
    ending = rng.random()
    if ending < 0.08:
        return out + b"zz\r\n"  # a chunk size that is not hex
    if ending < 0.14:
        return out + b"ffffffffffffffffff\r\nabc"
    if ending < 0.2:
        return out  # no last chunk
    if ending < 0.25:
        return out + b"5\r\nabcdefgh\r\n0\r\n\r\n"  # a chunk longer than its size
    return out + b"0\r\n\r\n"


def reply(seed: int) -> tuple[bytes, str]:
    """The bytes the worker answers case ``seed`` with, and what it does after them."""
    rng = random.Random(seed)
    stream = rng.random() < 0.5
    body = _sse_answer(rng) if stream else _json_answer(rng)
    status = rng.choice(STATUS_LINES) if rng.random() < 0.3 else b"HTTP/1.1 200 OK"
    headers = [b"Content-Type: " + (b"text/event-stream" if stream else b"application/json")]
    framing = rng.choice(["length", "length", "chunked", "chunked", "close"])
    if framing == "length":
        length = len(body)
        if rng.random() < 0.15:
            length = rng.choice([length + 10, max(0, length - 3), 0])
        headers.append(b"Content-Length: %d" % length)
    elif framing == "chunked":
        headers.append(b"Transfer-Encoding: chunked")
        body = _chunked(body, rng)
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        headers.insert(rng.randrange(len(headers) + 1), rng.choice(ODD_HEADERS))
    eol = rng.choice([b"\n", b"\r"]) if rng.random() < 0.05 else b"\r\n"
    data = status + eol + eol.join(headers) + eol + eol + body
    if rng.random() < 0.1:
        data = data[:rng.randrange(1, len(data))]  # cut anywhere
    after = "close" if framing == "close" else rng.choice(["keep", "keep", "close", "hang"])
    return data, after


class HostileWorker:
    """Probes answered properly; each inference request with :func:`reply` of its case."""

    def __init__(self) -> None:
        self.server: asyncio.AbstractServer | None = None
        self.cases = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                path = head.split(b" ")[1]
                if path.startswith(b"/load"):
                    data = json.dumps({"worker_id": "hostile", "block_size": 16, "max_num_seqs": 64}).encode()
                elif path.startswith(b"/v1/models"):
                    data = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
                elif path.startswith(b"/health"):
                    data = b"{}"
                else:
                    found = CASE.search(body)
                    if found is None:  # not one of the cases: no answer
                        return
                    self.cases += 1
                    answer, after = reply(int(found.group(1)))
                    writer.write(answer)
                    await writer.drain()
                    if after == "hang":  # silent until the router gives up on the connection
                        while await reader.read(1 << 16):
                            pass
                    if after != "keep":
                        return
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                             % (len(data), data))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def _ask(http: aiohttp.ClientSession, url: str, seed: int) -> tuple[int, str | None]:
    """One case through the router; returns (status, the problem seen, or None)."""
    rng = random.Random(-seed)
    stream = rng.random() < 0.5
    chat = rng.random() < 0.3
    body = {"model": "m", "max_tokens": 2, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": "x"}]
        body["prompt"] = f"case {seed}"  # read by the hostile worker; the router renders messages
    else:
        body["prompt"] = f"case {seed}"
    try:
        async with asyncio.timeout(READ_TIMEOUT_S + 8):
            async with http.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as resp:
                raw = await resp.read()
    except TimeoutError:
        return -1, "no answer in time"
    except aiohttp.ClientError as e:
        return -1, f"broken answer: {e!r}"
    if resp.status == 500:
        return resp.status, f"a 500: {raw[:300]!r}"
    if resp.status != 200 or resp.content_type == "application/json" and not stream:
        if resp.status >= 400:
            try:
                error = json.loads(raw)["error"]
                assert isinstance(error["message"], str) and isinstance(error["type"], str)
            except Exception:
                if resp.status in (502, 503, 504):
                    return resp.status, f"not OpenAI's error shape: {raw[:300]!r}"
        return resp.status, None
    if stream and resp.content_type == "text/event-stream" and not raw.endswith(b"data: [DONE]\n\n"):
        return resp.status, f"a stream that does not end with [DONE]: {raw[-200:]!r}"
    return resp.status, None


async def test_no_worker_answer_breaks_the_router():
    worker = HostileWorker()
    url = await worker.start()
    async with running_router("--worker", url, "--max-attempts", "1", "--read-timeout", str(READ_TIMEOUT_S),
                           "--unhealthy-after", "1000000", "--health-interval", "60",
                           "--admin-token", ADMIN_TOKEN) as (ctx, router_url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 1, what="the hostile worker routable")
        problems: list[str] = []
        statuses: dict[int, int] = {}
        async with aiohttp.ClientSession() as http:
            for start in range(FIRST_SEED, FIRST_SEED + CASES, 24):
                seeds = range(start, min(start + 24, FIRST_SEED + CASES))
                for seed, (status, problem) in zip(seeds, await asyncio.gather(*(_ask(http, router_url, s)
                                                                                 for s in seeds))):
                    statuses[status] = statuses.get(status, 0) + 1
                    if problem:
                        problems.append(f"case {seed} ({reply(seed)[0][:160]!r}, then {reply(seed)[1]}): "
                                        f"{status} {problem}")
            assert not problems, "\n".join(problems[:8]) + f"\n({len(problems)} in all)"
            # (a few never reach the worker: sent on a connection whose worker "hangs" after a whole answer)
            assert worker.cases >= CASES * 0.9 and statuses.get(200, 0) > CASES // 5 and statuses.get(502, 0) > CASES // 10
            # and the router serves on: the hostile worker swapped for a good one, requests go through
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with scripted_workers("good") as (good,):
                async with http.post(router_url + "/admin/workers", json={"url": good.url}, headers=admin) as resp:
                    assert resp.status == 201, await resp.text()
                async with http.delete(router_url + "/admin/workers/hostile", headers=admin) as resp:
                    assert resp.status == 200, await resp.text()
                await wait_until(lambda: [w.worker_id for w in ctx.registry.all()] == ["good"] and
                                 len(ctx.balancer.routable()) == 1, what="the good worker alone routable")
                for stream in (False, True):
                    async with http.post(router_url + "/v1/completions",
                                         json={"model": "m", "prompt": "good", "stream": stream}) as resp:
                        raw = await resp.read()
                        assert resp.status == 200 and resp.headers["X-Prefixlb-Worker"] == "good"
                        assert raw.endswith(b"data: [DONE]\n\n") if stream else json.loads(raw)["choices"][0]["text"] == "ok"


async def test_a_stream_ends_for_the_client_at_done_even_if_the_worker_then_hangs():
    """A worker that sends ``data: [DONE]`` and then neither ends its body nor closes: the client's
    stream is whole at once (not after ``--read-timeout``), with nothing after ``[DONE]``."""
    done_then_silent = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"%x\r\n%b\r\n" % (len(EVENTS), EVENTS))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if head.startswith(b"POST"):
                    writer.write(done_then_silent)
                    while await reader.read(1 << 16):  # silent until the router drops the connection
                        pass
                    return
                data = json.dumps({"worker_id": "w", "block_size": 16} if b"/load" in head else
                                  {"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(data), data))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_router("--worker", url, "--read-timeout", "30") as (ctx, router_url):
            await wait_until(lambda: len(ctx.balancer.routable()) == 1, what="the worker routable")
            async with aiohttp.ClientSession() as http:
                async with asyncio.timeout(5):
                    async with http.post(router_url + "/v1/completions",
                                         json={"model": "m", "prompt": "p", "stream": True}) as resp:
                        assert resp.status == 200
                        assert await resp.read() == EVENTS.split(b"data: [DONE]\n\n")[0] + b"data: [DONE]\n\n"
    finally:
        server.close()


EVENTS = (b'data: {"choices": [{"index": 0, "text": "a"}], "usage": null}\n\ndata: [DONE]\n\n'
          b'data: {"choices": [{"index": 0, "text": "after the end"}]}\n\n')
