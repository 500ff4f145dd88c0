"""The fast front answers every request byte for byte as aiohttp alone does (``--no-fast-front``).

router/http/front.py reads plain inference requests itself and hands everything else to aiohttp
before a byte of it is used; its promise is that no client can tell the two apart (nor stop the
router with bytes aiohttp would refuse). This sends the same random, mostly malformed requests --
mutated request lines, header names and values, framing, lengths, line endings, bodies, split
writes -- to a router with the fast front and to one without, each request followed on its
connection by a ``Connection: close`` request, and compares all the bytes each connection got
back (less the ``Date`` and request-id headers). Seeded: a failure names its case to replay.

One difference is allowed, in the fast front's favour: aiohttp parses everything one read brought
before it answers any of it, and a malformed request there (say the rest of a body longer than its
``Content-Length``) makes it answer only that 400, dropping the answers to the valid requests
before it in the same read. The fast front answers those first, then hands the malformed bytes to
aiohttp for the same 400 (or closes the connection, where the last request it answered said
``Connection: close``: what follows it is not read, where aiohttp calls it "data after close").
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re

import pytest

from tests.integration.router_harness import running_router, scripted_workers, wait_until

CASES = 400
FIRST_SEED = int(os.environ.get("PREFIXLB_FRONT_FUZZ_SEED", "0"))  # another run of cases: set it
SENTINEL = b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n"
PER_REQUEST = re.compile(rb"(?im)^(date|x-request-id|x-prefixlb-request-id):[^\r\n]*\r\n")

BODIES = [
    {"model": "m", "prompt": "hello there, a prompt long enough to hash", "max_tokens": 2},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    {"model": "m", "prompt": "streamed", "max_tokens": 2, "stream": True},
    {"model": "m", "messages": [{"role": "user", "content": "s"}], "stream": True,
     "stream_options": {"include_usage": True}},
    {"model": "nope", "prompt": "x"},
    {"model": "m"},
    {"model": "m", "prompt": "x", "max_tokens": -1},
]
RAW_BODIES = [b"{", b"[]", b"", b'{"model": "m", "prompt": "\xff\xfe"}', b"null", b'{"model": "m", "prompt": "a"}  x',
              b'{"model": "m", "prompt": "\\ud800"}', b'\xef\xbb\xbf{"model": "m", "prompt": "bom"}']
EXTRA_HEADERS = [
    "X-Foo: bar", "Accept: */*", "Connection: keep-alive", "Connection: close", "Connection: Upgrade",
    "Connection: close, keep-alive", "Expect: 100-continue", "Transfer-Encoding: chunked",
    "Transfer-Encoding: identity", "Content-Encoding: identity", "Content-Encoding: br", "Authorization: Bearer x",
    "User-Agent: a", "User-Agent: b", "Host:", "Host: other", "X-Prefixlb-Session: s", "Content-Type: text/plain",
    "Content-Type: application/json; charset=utf-8", "X-Latin: caf\xe9", "X-Nul: a\x00b", "Bad Name: x",
    "NoColon", ": empty-name", "X-Long: " + "v" * 9000, "Upgrade: websocket", "Sec-WebSocket-Key1: x",
    "X-Tab:\tvalue\t", "X-Space:  value  ", "Content-Length: 3", "content-length: 0", "Keep-Alive: timeout=1",
    "X-Bad\x7fName: x", "X-Ctl: a\x01b", "Cookie: a=b", "X-Request-Id: client-chosen",
]
METHODS = ["POST", "POST", "POST", "post", "PUT", "GET", "POSTX", "P OST"]
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/completions/", "/v1//completions", "/V1/completions",
         "/v1/completions?", "/v1/completions?x=1", "/v1/%63ompletions", "*", "http://router/v1/completions",
         "/v1/completions#frag", "/../v1/completions", "/v1/completions\x00", "/v1/completi ons"]
VERSIONS = ["HTTP/1.1", "HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/1.2", "HTTP/2.0", "http/1.1", "HTTP/1.1 ", "HTTP/11"]


def _case(seed: int) -> tuple[bytes, list[int]]:
    """One request's bytes and where its writes are cut (seeded)."""
    rng = random.Random(seed)
    body = (rng.choice(RAW_BODIES) if rng.random() < 0.2
            else json.dumps(rng.choice(BODIES), separators=rng.choice([(", ", ": "), (",", ":")])).encode())
    mutate = rng.random() < 0.85
    method = rng.choice(METHODS) if mutate and rng.random() < 0.15 else "POST"
    path = rng.choice(PATHS) if mutate and rng.random() < 0.25 else rng.choice(PATHS[:2])
    version = rng.choice(VERSIONS) if mutate and rng.random() < 0.2 else "HTTP/1.1"
    sep = rng.choice(["  ", "\t"]) if mutate and rng.random() < 0.05 else " "
    length = len(body)
    length_text = str(length)
    if mutate and rng.random() < 0.25:
        length_text = rng.choice([f"+{length}", f"{length} ", f" {length}", f"0{length}", f"{length},{length}", "-1",
                                  "99999999999999999999", "abc", str(max(0, length - 5)), str(length + 5), "",
                                  f"{length}\t", "0x10"])
    headers = ["Host: router", "Content-Type: application/json", f"Content-Length: {length_text}"]
    if mutate:
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            headers.insert(rng.randrange(len(headers) + 1), rng.choice(EXTRA_HEADERS))
        if rng.random() < 0.15:
            headers = [h.upper() if rng.random() < 0.5 else h.lower() for h in headers]
        if rng.random() < 0.1:
            headers = [h.replace(": ", rng.choice([":", ":\t", ":   "]), 1) for h in headers]
        if rng.random() < 0.05:
            headers += [f"X-Many-{i}: {i}" for i in range(rng.choice([60, 70, 130]))]
        if rng.random() < 0.05:
            rng.shuffle(headers)
    eol = rng.choice(["\n", "\r\r\n", "\r"]) if mutate and rng.random() < 0.05 else "\r\n"
    lead = rng.choice(["\r\n", " ", "\r\n\r\n"]) if mutate and rng.random() < 0.03 else ""
    head = lead + f"{method}{sep}{path}{sep}{version}" + eol + eol.join(headers) + eol + eol
    data = head.encode("latin-1") + body
    if mutate and rng.random() < 0.1:  # pipelined behind another plain request
        data = data + _case(seed + 10_000)[0] if rng.random() < 0.5 else _case(seed + 20_000)[0] + data
    cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.choice([0, 0, 0, 1, 2]))))
    return data, cuts


async def _exchange(host: str, port: int, data: bytes, cuts: list[int], timeout_s: float = 3.0) -> bytes:
    """Everything the connection gets back for ``data`` (written in pieces at ``cuts``) and the sentinel."""
    reader, writer = await asyncio.open_connection(host, port)
    out = b""
    try:
        last = 0
        for cut in cuts:
            writer.write(data[last:cut])
            last = cut
            await asyncio.sleep(0.01)  # within the front's body wait: still its to read
        writer.write(data[last:] + SENTINEL)
        try:
            async with asyncio.timeout(timeout_s):
                while chunk := await reader.read(1 << 16):
                    out += chunk
        except TimeoutError:
            out += b"<no close in time>"
        except ConnectionResetError:
            out += b"<reset>"
    finally:
        writer.close()
    return PER_REQUEST.sub(b"", out)


@pytest.fixture
async def two_routers():
    async with scripted_workers("w1", "w1") as (fast_worker, plain_worker), \
            running_router("--worker", fast_worker.url) as (fast_ctx, fast_url), \
            running_router("--worker", plain_worker.url, "--no-fast-front") as (plain_ctx, plain_url):
        await wait_until(lambda: len(fast_ctx.balancer.routable()) == len(plain_ctx.balancer.routable()) == 1,
                         what="the workers routable")
        yield fast_ctx, fast_url, plain_url


def _responses(out: bytes) -> list[tuple[bytes, bytes, dict]]:
    """The (status line, body, headers) of each whole HTTP/1.x response in ``out``."""
    found = []
    while b"\r\n\r\n" in out:
        head, _, rest = out.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:] if b": " in line)
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                body, rest = body + rest[:size], rest[size + 2:]
                if size == 0:
                    break
        else:
            size = int(headers.get(b"content-length", b"0"))
            body, rest = rest[:size], rest[size:]
        found.append((lines[0], body, headers))
        out = rest
    return found


def _malformed(response: tuple[bytes, bytes, dict]) -> bool:
    status, body, _ = response
    return status.split(b" ")[1] == b"400" and b'"code": "malformed_request"' in body


def _ending(out: bytes) -> bytes:
    """How the exchange ended: the marker :func:`_exchange` added, or b"" (closed by the router)."""
    return out[out.rindex(b"<"):] if out.endswith(b">") else b""


def _shape(response: tuple[bytes, bytes, dict]) -> tuple:
    status, body, headers = response
    if _malformed(response):
        return status, {k: v for k, v in headers.items() if k != b"content-length"}
    return status, body, headers


def _alike(fast: bytes, plain: bytes) -> bool:
    """The same bytes, or the one difference allowed (the module docstring)."""
    if fast == plain:
        return True
    plain_answers, fast_answers = _responses(plain), _responses(fast)
    if _ending(fast) != _ending(plain):
        return False
    if [_shape(r) for r in fast_answers] == [_shape(r) for r in plain_answers]:
        return True  # only a malformed request's message differs: it quotes what aiohttp's read held
    return (len(plain_answers) == 1 and _malformed(plain_answers[0]) and len(fast_answers) >= 1
            and (_malformed(fast_answers[-1]) or fast_answers[-1][2].get(b"connection") == b"close"))


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def test_the_fast_front_and_aiohttp_answer_random_malformed_requests_alike(two_routers):
    fast_ctx, fast_url, plain_url = two_routers
    fast, plain = _address(fast_url), _address(plain_url)
    differences = []
    for start in range(FIRST_SEED, FIRST_SEED + CASES, 16):
        seeds = range(start, min(start + 16, FIRST_SEED + CASES))
        cases = [_case(seed) for seed in seeds]
        answers = await asyncio.gather(*(_exchange(*fast, *case) for case in cases),
                                       *(_exchange(*plain, *case) for case in cases))
        for seed, case, a, b in zip(seeds, cases, answers[:len(cases)], answers[len(cases):]):
            if not _alike(a, b):  # again, alone and with time to spare: a busy box is not a difference
                a, b = await asyncio.gather(_exchange(*fast, *case, timeout_s=10), _exchange(*plain, *case, timeout_s=10))
            if not _alike(a, b):
                differences.append((seed, case[0][:300], a[:600], b[:600]))
    assert not differences, "\n\n".join(f"seed {s}: {req!r}\n fast:  {a!r}\n aiohttp: {b!r}"
                                        for s, req, a, b in differences[:5]) + f"\n({len(differences)} in all)"
    assert fast_ctx.front.requests > CASES // 6 and fast_ctx.front.handed_over > CASES // 6  # both paths taken
