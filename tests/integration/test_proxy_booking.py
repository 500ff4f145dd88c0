"""The proxy releases every booking of a worker exactly once, whichever way its attempt ends.

A booking (``Balancer.dispatch``) puts the request's work on the worker's load board; its
release (``Balancer.finish``) takes it off and feeds back the worker's usage. A leak leaves the
worker looking busy for good, a second release makes it look idler than it is (and counts its
usage twice). The real router runs in-process against scripted workers over loopback; the
balancer's own ``dispatch`` and ``finish`` are wrapped to record each booking and each release.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Iterator

import aiohttp
import pytest

from router.routing.prompt import prompt_key
from tests.integration.router_harness import faulty_workers, running_router, wait_until

BODY = {"model": "m", "prompt": "Compare the two warranty clauses. " * 12, "max_tokens": 2}
STREAM = {**BODY, "stream": True}


@dataclass
class Ledger:
    """Bookings in the order they were made, releases in the order they happened."""

    booked: list = field(default_factory=list)
    released: list = field(default_factory=list)

    def released_once_each(self) -> list[int]:
        """How many times each booking was released, in booking order."""
        return [sum(r is b for r in self.released) for b in self.booked]


@contextlib.contextmanager
def ledger_of(balancer) -> Iterator[Ledger]:
    ledger = Ledger()
    dispatch, finish = balancer.dispatch, balancer.finish

    def recorded_dispatch(*args, **kwargs):
        booking = dispatch(*args, **kwargs)
        ledger.booked.append(booking)
        return booking

    def recorded_finish(booking, *args, **kwargs):
        ledger.released.append(booking)
        return finish(booking, *args, **kwargs)

    balancer.dispatch, balancer.finish = recorded_dispatch, recorded_finish
    try:
        yield ledger
    finally:
        del balancer.dispatch, balancer.finish


async def _settled(ctx) -> None:
    """The request's handler is done: its admission slot, freed after the booking's release."""
    await wait_until(lambda: ctx.proxy.admission.inflight == 0, what="the request's handler to end")


async def _served(ctx, url: str, body: dict) -> Ledger:
    """Send ``body``, expect a 200 read to its end; the bookings and releases that made it."""
    with ledger_of(ctx.balancer) as ledger:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        await _settled(ctx)
    return ledger


def _first_choice(ctx, body: dict) -> str:
    key = prompt_key(body, False, ctx.config.chunk_size, ctx.config.ring_key_chunks)
    return ctx.balancer.decide(key, 0.0).worker_id


def _args(workers) -> list[str]:
    return [a for w in workers for a in ("--worker", w.url)]


@pytest.mark.parametrize("body", [BODY, STREAM], ids=["complete", "stream"])
async def test_a_served_request_releases_its_booking_once_with_the_workers_usage(body):
    async with faulty_workers("w1") as (worker,), running_router(*_args([worker])) as (ctx, url):
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="w1 routable")
        ledger = await _served(ctx, url, body)
        assert ledger.released_once_each() == [1]
        assert ctx.balancer.board.get("w1").in_system == 0
        assert ctx.balancer.tokens_per_byte("m") != ctx.config.tokens_per_byte  # the usage was learnt from


@pytest.mark.parametrize("body", [BODY, STREAM], ids=["complete", "stream"])
async def test_a_worker_error_before_the_first_byte_releases_that_booking_once_and_the_retry_its_own(body):
    async with faulty_workers("w1", "w2") as workers, running_router(*_args(workers)) as (ctx, url):
        await wait_until(lambda: len(ctx.balancer.routable()) == 2, what="2 routable workers")
        failing = next(w for w in workers if w.worker_id == _first_choice(ctx, BODY))
        failing.mode = "error"
        ledger = await _served(ctx, url, body)
        assert [b.decision.worker_id for b in ledger.booked] == [failing.worker_id,
                                                                 next(w.worker_id for w in workers if w is not failing)]
        assert ledger.released_once_each() == [1, 1]
        assert [ctx.balancer.board.get(w.worker_id).in_system for w in workers] == [0, 0]


@pytest.mark.parametrize("mode", ["held", "gated"], ids=["before_first_byte", "mid_stream"])
async def test_a_client_disconnect_releases_the_booking_once(mode):
    async with faulty_workers("w1") as (worker,), running_router(*_args([worker])) as (ctx, url):
        worker.mode = mode
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="w1 routable")
        with ledger_of(ctx.balancer) as ledger:
            http = aiohttp.ClientSession()
            sent = asyncio.ensure_future(http.post(url + "/v1/completions", json=STREAM))
            if mode == "gated":
                resp = await asyncio.wait_for(sent, 10)
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)  # the first event arrived
                resp.close()
            else:
                await wait_until(lambda: len(worker.bodies) == 1, what="the request to reach the worker")
                sent.cancel()
            await http.close()
            await wait_until(worker.disconnected.is_set, what="the worker to see the disconnect")
            await _settled(ctx)
        assert ledger.released_once_each() == [1]
        assert ctx.balancer.board.get("w1").in_system == 0


async def test_a_worker_failing_mid_stream_releases_the_booking_once():
    async with faulty_workers("w1") as (worker,), running_router(*_args([worker])) as (ctx, url):
        worker.mode = "die"
        await wait_until(lambda: ctx.balancer.routable() == ["w1"], what="w1 routable")
        with ledger_of(ctx.balancer) as ledger:
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/completions", json=STREAM) as resp:
                    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
                    worker.gate.set()  # now the connection drops
                    events = (await resp.read()).split(b"\n\n")
            await _settled(ctx)
        assert json.loads(events[0][6:])["error"]["code"] == "upstream_failed"
        assert ledger.released_once_each() == [1]
        assert ctx.balancer.board.get("w1").in_system == 0
