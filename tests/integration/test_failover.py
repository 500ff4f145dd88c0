"""Failover in the router's proxy, against scripted faulty workers over loopback HTTP.

Each fault is scripted byte by byte (``router_harness.FaultyWorker``), so every test knows exactly where the
failure falls: before the first byte (retried, invisible to the client), after it (a clean SSE
error event, never a truncated success), or never (a hang, which the breaker ends).
The real-process versions (kill -9, SIGSTOP) are in ``test_chaos.py``.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp

from router.routing.prompt import prompt_key
from tests.integration.router_harness import faulty_workers, running_router, wait_until

BODY = {"model": "m", "prompt": "Explain the indemnity clause. " * 12, "max_tokens": 2}
STREAM = {**BODY, "stream": True}


def _args(workers, *extra: str) -> list[str]:
    return [*extra, *[a for w in workers for a in ("--worker", w.url)]]


async def _ready(ctx, n: int) -> None:
    await wait_until(lambda: len(ctx.balancer.routable()) == n, what=f"{n} routable workers")


def _first_choice(ctx, body: dict) -> str:
    key = prompt_key(body, False, ctx.config.chunk_size, ctx.config.ring_key_chunks)
    return ctx.balancer.decide(key, 0.0).worker_id


def _data(raw: bytes) -> list:
    out = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


async def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event_not_a_truncated_success():
    async with faulty_workers("w1") as (worker,), running_router(*_args([worker])) as (ctx, url):
        worker.mode = "die"
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=STREAM) as resp:
                assert resp.status == 200
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)  # the first token arrived
                worker.gate.set()
                rest = _data(await resp.read())
        assert rest[-1] == "[DONE]"
        assert rest[0]["error"]["code"] == "upstream_failed"
        assert "mid_stream" in rest[0]["error"]["message"]
        assert ctx.registry.get("w1").failures == 1  # counted by its breaker (one is not enough)


async def test_a_stream_that_ends_without_done_gets_the_error_event():
    async with faulty_workers("w1") as (worker,), running_router(*_args([worker])) as (ctx, url):
        worker.mode = "no_done"
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=STREAM) as resp:
                events = _data(await resp.read())
        assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
        assert events[2]["error"]["code"] == "upstream_failed" and "truncated" in events[2]["error"]["message"]
        assert events[3:] == ["[DONE]"]


async def test_a_hung_worker_is_taken_out_by_the_breaker_and_its_waiting_requests_move_on():
    async with faulty_workers("w1", "w2") as workers, \
            running_router(*_args(workers, "--health-interval", "0.2", "--health-timeout", "0.3",
                                  "--health-jitter", "0")) as (ctx, url):
        await _ready(ctx, 2)
        hung = next(w for w in workers if w.worker_id == _first_choice(ctx, BODY))
        other = next(w for w in workers if w is not hung)
        hung.mode, hung.probe_hang = "hang", True  # like SIGSTOP: connections open, nothing answers
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                assert resp.headers["X-Prefixlb-Worker"] == other.worker_id
        assert hung.requests == 1  # it was tried first, and abandoned when its breaker opened
        assert ctx.registry.get(hung.worker_id).state == "unhealthy"
        assert ctx.balancer.routable() == [other.worker_id]


async def test_a_stream_on_a_worker_that_hangs_mid_stream_ends_with_the_error_event():
    async with faulty_workers("w1") as (worker,), \
            running_router(*_args([worker], "--health-interval", "0.2", "--health-timeout", "0.3",
                                  "--health-jitter", "0")) as (ctx, url):
        worker.mode = "gated"
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=STREAM) as resp:
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
                worker.probe_hang = True  # the process stops mid-stream
                rest = _data(await asyncio.wait_for(resp.read(), 20))
        assert rest[0]["error"]["code"] == "upstream_failed" and "aborted" in rest[0]["error"]["message"]
        assert rest[1:] == ["[DONE]"]


async def test_retries_are_bounded_by_max_attempts_then_the_client_gets_a_502():
    async with faulty_workers("w1", "w2", "w3") as workers, \
            running_router(*_args(workers, "--max-attempts", "2", "--unhealthy-after", "5")) as (ctx, url):
        await _ready(ctx, 3)
        for w in workers:
            w.mode = "error"
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 502
                error = (await resp.json())["error"]
        assert (error["type"], error["code"]) == ("server_error", "upstream_failed")
        assert sum(w.requests for w in workers) == 2


async def test_no_retry_starts_after_the_retry_deadline():
    async with faulty_workers("w1", "w2") as workers, \
            running_router(*_args(workers, "--retry-deadline", "0")) as (ctx, url):
        await _ready(ctx, 2)
        first = next(w for w in workers if w.worker_id == _first_choice(ctx, BODY))
        first.mode = "error"
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 502
        assert [w.requests for w in workers] == [1 if w is first else 0 for w in workers]


async def test_a_draining_worker_is_skipped_at_once_without_counting_against_its_health():
    async with faulty_workers("w1", "w2") as workers, \
            running_router(*_args(workers, "--health-interval", "60")) as (ctx, url):
        await _ready(ctx, 2)
        draining = next(w for w in workers if w.worker_id == _first_choice(ctx, BODY))
        draining.mode = "draining"
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                assert resp.headers["X-Prefixlb-Worker"] != draining.worker_id
        w = ctx.registry.get(draining.worker_id)
        assert (w.state, w.failures) == ("draining", 0)
        assert ctx.balancer.routable() == [x.worker_id for x in workers if x is not draining]


async def test_requests_over_the_limits_wait_in_the_queue_and_are_served_when_capacity_frees():
    async with faulty_workers("w1") as (worker,), \
            running_router(*_args([worker], "--max-inflight-per-worker", "1", "--queue-timeout", "30")) as (ctx, url):
        worker.mode = "gated"
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            held = await http.post(url + "/v1/completions", json=STREAM)
            await asyncio.wait_for(held.content.readuntil(b"\n\n"), 10)
            waiting = asyncio.create_task(http.post(url + "/v1/completions", json=BODY))
            await wait_until(lambda: len(ctx.proxy.admission) == 1, what="the second request to queue")
            worker.gate.set()
            await held.read()
            held.release()
            resp = await asyncio.wait_for(waiting, 10)
            assert resp.status == 200
            resp.release()


async def test_a_request_that_cannot_be_served_within_the_queue_timeout_gets_a_429():
    async with faulty_workers("w1") as (worker,), \
            running_router(*_args([worker], "--max-inflight-per-worker", "1", "--queue-timeout", "0.2")) as (ctx, url):
        worker.mode = "gated"
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            held = await http.post(url + "/v1/completions", json=STREAM)
            await asyncio.wait_for(held.content.readuntil(b"\n\n"), 10)
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert (resp.status, resp.headers["Retry-After"]) == (429, "1")
                assert (await resp.json())["error"]["code"] == "overloaded"
            worker.gate.set()
            await held.read()
            held.release()
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
        assert 'prefixlb_router_overload_rejections_total{reason="queue_timeout"} 1.0' in text


async def test_the_global_in_flight_limit_queues_and_a_full_queue_refuses_at_once():
    async with faulty_workers("w1", "w2") as workers, \
            running_router(*_args(workers, "--max-inflight", "1", "--max-queue", "0")) as (ctx, url):
        for w in workers:
            w.mode = "gated"
        await _ready(ctx, 2)
        async with aiohttp.ClientSession() as http:
            held = await http.post(url + "/v1/completions", json=STREAM)
            await asyncio.wait_for(held.content.readuntil(b"\n\n"), 10)
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 429  # w2 is idle, but the router itself is at its limit
            for w in workers:
                w.gate.set()
            await held.read()
            held.release()


async def test_a_request_waiting_for_a_busy_worker_does_not_hold_back_a_request_for_an_idle_one():
    # A request for model m waits for m's only worker; one for model b, whose worker is idle, must
    # not queue behind it (it needs no global slot anyone is waiting for).
    async with faulty_workers("w1", "w2") as (w1, w2):
        w1.mode, w2.model = "gated", "b"
        async with running_router(*_args([w1, w2], "--max-inflight-per-worker", "1",
                                          "--queue-timeout", "3")) as (ctx, url):
            await _ready(ctx, 2)
            async with aiohttp.ClientSession() as http:
                held = await http.post(url + "/v1/completions", json=STREAM)
                await asyncio.wait_for(held.content.readuntil(b"\n\n"), 10)
                waiting = asyncio.create_task(http.post(url + "/v1/completions", json=BODY))
                await wait_until(lambda: len(ctx.proxy.admission) == 1, what="the model-m request to queue")
                # at once, well within the queue timeout of the request it queued behind
                resp = await asyncio.wait_for(http.post(url + "/v1/completions", json={**BODY, "model": "b"}), 2)
                assert (resp.status, resp.headers.get("X-Prefixlb-Worker")) == (200, "w2")
                resp.release()
                w1.gate.set()
                await held.read()
                held.release()
                resp = await asyncio.wait_for(waiting, 10)
                assert resp.status == 200
                resp.release()


async def test_a_freed_global_slot_is_not_lost_to_a_waiter_that_already_holds_one():
    # Two global slots: one held on w1 (model m), one by a model-m request waiting for w1. A model-b
    # request waits for a global slot. When the first finishes, the m waiter takes w1 -- and the
    # global slot it freed must go to the b request, not wait for the next request to finish.
    async with faulty_workers("w1", "w2") as (w1, w2):
        w1.mode, w2.model = "gated", "b"
        async with running_router(*_args([w1, w2], "--max-inflight", "2", "--max-inflight-per-worker", "1",
                                          "--queue-timeout", "3")) as (ctx, url):
            await _ready(ctx, 2)
            adm = ctx.proxy.admission
            async with aiohttp.ClientSession() as http:
                held = await http.post(url + "/v1/completions", json=STREAM)
                await asyncio.wait_for(held.content.readuntil(b"\n\n"), 10)
                second = asyncio.create_task(http.post(url + "/v1/completions", json=STREAM))
                await wait_until(lambda: (adm.inflight, len(adm)) == (2, 1), what="the m request to wait for w1")
                other = asyncio.create_task(http.post(url + "/v1/completions", json={**BODY, "model": "b"}))
                await wait_until(lambda: len(adm) == 2, what="the b request to wait for a global slot")
                w1.gate.set()
                w1.gate.clear()  # the first stream ends; the second is held on w1
                await held.read()
                held.release()
                resp = await asyncio.wait_for(other, 2)  # well within its queue timeout
                assert (resp.status, resp.headers.get("X-Prefixlb-Worker")) == (200, "w2")
                resp.release()
                resp = await asyncio.wait_for(second, 10)
                assert resp.status == 200
                w1.gate.set()
                await resp.read()
                resp.release()
