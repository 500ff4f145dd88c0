"""The router's HTTP behaviour against scripted workers: streaming, disconnects, retries, errors, admin.

Each test runs the real router app in-process over loopback HTTP; the workers are scripted
(``router_harness.ScriptedWorker``) so that every byte's timing is decided by the test.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from protocol import LoadReport
from router.routing.prompt import prompt_key
from tests.integration.router_harness import USAGE, ScriptedWorker, running_router, scripted_workers, wait_until

PROMPT = "Summarise the following contract. " * 20
BODY = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
ADMIN = {"Authorization": "Bearer s3cret"}


async def _ready(ctx, n: int) -> None:
    await wait_until(lambda: len(ctx.balancer.routable()) == n, what=f"{n} routable workers")


def _owner(ctx, body: dict) -> str:
    """The worker the router will choose first for ``body`` (nothing cached, all idle)."""
    key = prompt_key(body, False, ctx.config.chunk_size, ctx.config.ring_key_chunks)
    return ctx.balancer.decide(key, 0.0).worker_id


async def _events(resp: aiohttp.ClientResponse) -> list[bytes]:
    return [e for e in (await resp.read()).split(b"\n\n") if e]


async def test_streamed_events_reach_the_client_before_the_worker_has_finished():
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url) as (ctx, url):
        worker.mode = "gated"
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json={**BODY, "stream": True}) as resp:
                assert resp.status == 200
                assert resp.headers["X-Prefixlb-Worker"] == "w1"
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=10)
                assert json.loads(first[6:])["choices"][0]["text"] == "a"
                assert not worker.gate.is_set()  # the worker is still holding the rest back
                worker.gate.set()
                rest = [e for e in (await resp.read()).split(b"\n\n") if e]
        assert json.loads(rest[0][6:])["choices"][0]["text"] == "b"
        assert rest[1:] == [b"data: [DONE]"]  # the usage chunk the client did not ask for is gone
        assert worker.bodies[0]["stream_options"] == {"include_usage": True}  # the router asked for it
        await wait_until(lambda: ctx.balancer.tokens_per_byte("m") != ctx.config.tokens_per_byte,
                         what="feedback from the usage chunk")
        assert ctx.balancer.tokens_per_byte("m") == pytest.approx(40 / len(PROMPT))


@dataclass
class PeerWorker(ScriptedWorker):
    """A scripted worker that notes the address each request came from."""

    peers: set = field(default_factory=set)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.peers.add(request.transport.get_extra_info("peername"))
        return await super()._completions(request)


@pytest.mark.parametrize("stream", [False, True])
async def test_answers_one_after_another_reuse_one_connection_to_the_worker(stream):
    """A stream ends for the client at ``data: [DONE]``; the worker's end of the body follows, and
    the connection goes back to the pool all the same (router/fleet/upstream.py)."""
    async with scripted_workers("w1", kind=PeerWorker) as (worker,), \
            running_router("--worker", worker.url) as (ctx, url):
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.post(url + "/v1/completions", json={**BODY, "stream": stream}) as resp:
                    assert resp.status == 200
                    if stream:
                        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
                    else:
                        assert json.loads(await resp.read())["choices"]
                await wait_until(lambda: ctx.proxy.connections.upstream._idle, what="the connection back in the pool")
        assert len(worker.bodies) == 5 and len(worker.peers) == 1


async def test_a_client_that_asked_for_usage_gets_the_usage_chunk():
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url) as (ctx, url):
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
            async with http.post(url + "/v1/completions", json=body) as resp:
                events = await _events(resp)
        assert json.loads(events[-2][6:]) == {"choices": [], "usage": USAGE}


async def test_a_client_disconnect_cancels_the_request_on_the_worker():
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url) as (ctx, url):
        worker.mode = "gated"
        await _ready(ctx, 1)
        http = aiohttp.ClientSession()
        resp = await http.post(url + "/v1/completions", json={**BODY, "stream": True})
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=10)
        resp.close()  # drop the connection mid-stream
        await http.close()
        await wait_until(worker.disconnected.is_set, what="the worker to see the disconnect")
        await wait_until(lambda: ctx.balancer.board.get("w1").in_system == 0, what="in-flight released")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_disconnect_before_the_first_byte_releases_the_workers_in_flight_count(stream):
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url) as (ctx, url):
        worker.mode = "held"  # no byte until the gate opens: the router waits for its first byte
        await _ready(ctx, 1)
        http = aiohttp.ClientSession()
        sent = asyncio.ensure_future(http.post(url + "/v1/completions", json={**BODY, "stream": stream}))
        await wait_until(lambda: len(worker.bodies) == 1, what="the request to reach the worker")
        assert ctx.balancer.board.get("w1").in_system == 1
        sent.cancel()  # the client gives up before the first byte
        await http.close()
        await wait_until(worker.disconnected.is_set, what="the worker to see the disconnect")
        await wait_until(lambda: ctx.proxy.admission.inflight == 0, what="the admission slot released")
        await wait_until(lambda: ctx.balancer.board.get("w1").in_system == 0, what="in-flight released")
        assert not ctx.balancer.board.get("w1").tickets


async def test_a_failing_worker_is_retried_on_another_before_the_first_byte():
    async with scripted_workers("w1", "w2") as workers, \
            running_router(*[a for w in workers for a in ("--worker", w.url)]) as (ctx, url):
        await _ready(ctx, 2)
        first = _owner(ctx, BODY)
        failing = next(w for w in workers if w.worker_id == first)
        other = next(w for w in workers if w.worker_id != first)
        failing.mode = "error"
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                assert resp.headers["X-Prefixlb-Worker"] == other.worker_id
                assert (await resp.json())["usage"] == USAGE
        assert (len(failing.bodies), len(other.bodies)) == (1, 1)


async def test_a_worker_that_went_away_is_retried_on_another_and_then_taken_out():
    async with scripted_workers("w1", "w2") as workers, \
            running_router("--health-interval", "60", *[a for w in workers for a in ("--worker", w.url)]) as (ctx, url):
        await _ready(ctx, 2)
        first = _owner(ctx, BODY)
        gone = next(w for w in workers if w.worker_id == first)
        await gone.server.close()  # connections now refused; the next probe is a minute away
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(url + "/v1/completions", json=BODY) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Prefixlb-Worker"] != first
        assert ctx.balancer.routable() == [w.worker_id for w in workers if w is not gone]


async def test_non_streaming_answers_carry_the_routing_headers_and_feed_the_metrics():
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url) as (ctx, url):
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                assert (resp.headers["X-Prefixlb-Worker"], resp.headers["X-Prefixlb-Predicted-Cached-Tokens"],
                        resp.headers["X-Prefixlb-Route-Reason"]) == ("w1", "0", "ring")
                assert (await resp.json())["choices"][0]["text"] == "ok"
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
        assert 'prefixlb_router_requests_total{reason="ring",worker="w1"} 1.0' in text
        assert 'prefixlb_router_reported_cached_tokens_total{worker="w1"} 32.0' in text
        assert 'prefixlb_router_worker_healthy{worker="w1"} 1.0' in text
        assert "prefixlb_router_decision_seconds_count 1.0" in text


@pytest.mark.parametrize("body,headers,status,param", [
    (b"{not json", {}, 400, None),
    (json.dumps({"model": "m"}).encode(), {}, 400, "prompt"),
    (json.dumps({**BODY, "model": "other"}).encode(), {}, 404, "model"),
    (json.dumps(BODY).encode(), {"X-Prefixlb-Affinity": "2"}, 400, "X-Prefixlb-Affinity"),
    (json.dumps({**BODY, "prompt": "x" * 3000}).encode(), {}, 413, None),
])
async def test_bad_requests_get_openai_shaped_4xx_errors(body, headers, status, param):
    async with scripted_workers("w1") as (worker,), \
            running_router("--worker", worker.url, "--max-body-bytes", "2048") as (ctx, url):
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **headers}) as resp:
                assert resp.status == status
                error = (await resp.json())["error"]
        assert error["param"] == param and error["message"] and error["type"]
        assert worker.bodies == []


async def test_without_healthy_workers_requests_get_a_503():
    async with running_router() as (ctx, url):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_workers"


async def test_workers_at_their_in_flight_limit_get_a_429_with_retry_after():
    async with scripted_workers("w1") as (worker,), \
            running_router("--worker", worker.url, "--max-inflight-per-worker", "1", "--max-queue", "0") as (ctx, url):
        worker.mode = "gated"
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            held = await http.post(url + "/v1/completions", json={**BODY, "stream": True})
            await asyncio.wait_for(held.content.readuntil(b"\n\n"), timeout=10)
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 429
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["type"] == "rate_limit_error"
            worker.gate.set()
            await held.read()
            held.release()


async def test_models_and_health_describe_the_fleet():
    async with scripted_workers("w1", "w2") as workers, \
            running_router(*[a for w in workers for a in ("--worker", w.url)]) as (ctx, url):
        await _ready(ctx, 2)
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
            async with http.get(url + "/health") as resp:
                assert await resp.json() == {"status": "ok", "routable_workers": 2, "known_workers": 2,
                                             "redis": "disabled"}


async def test_the_admin_api_needs_the_token_and_manages_workers_and_config():
    async with scripted_workers("w1", "w2") as (w1, w2), \
            running_router("--worker", w1.url, "--admin-token", "s3cret") as (ctx, url):
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/admin/workers") as resp:
                assert resp.status == 401
            async with http.get(url + "/admin/workers", headers={"Authorization": "Bearer nope"}) as resp:
                assert resp.status == 403
            async with http.post(url + "/admin/workers", json={"url": "ftp://x"}, headers=ADMIN) as resp:
                assert resp.status == 400
            async with http.post(url + "/admin/workers", json={"url": w2.url}, headers=ADMIN) as resp:
                assert resp.status == 201
            await _ready(ctx, 2)
            async with http.get(url + "/admin/workers", headers=ADMIN) as resp:
                listed = {w["worker_id"]: w["state"] for w in (await resp.json())["workers"]}
            assert listed == {"w1": "healthy", "w2": "healthy"}
            async with http.post(url + "/admin/workers/w1/drain", headers=ADMIN) as resp:
                assert resp.status == 200
            assert ctx.balancer.routable() == ["w2"]
            async with http.delete(url + "/admin/workers/w2", headers=ADMIN) as resp:
                assert resp.status == 200
            async with http.delete(url + "/admin/workers/w2", headers=ADMIN) as resp:
                assert resp.status == 404
            async with http.put(url + "/admin/config", json={"affinity": 0.3, "policy": "least_load"},
                                headers=ADMIN) as resp:
                assert await resp.json() == {"runtime": {"affinity": 0.3, "policy": "least_load", "prewarm_top": 0},
                                             "shared": False}
            async with http.put(url + "/admin/config", json={"affinity": 3}, headers=ADMIN) as resp:
                assert resp.status == 400
            async with http.get(url + "/admin/config", headers=ADMIN) as resp:
                cfg = await resp.json()
        assert cfg["runtime"] == {"affinity": 0.3, "policy": "least_load", "prewarm_top": 0}
        assert cfg["settings"]["admin_token"] == "***"
        assert ctx.balancer.config.policy == "least_load"


async def test_the_affinity_header_overrides_the_routers_affinity_per_request():
    async with scripted_workers("w1", "w2") as workers, \
            running_router("--health-interval", "60", *[a for w in workers for a in ("--worker", w.url)]) as (ctx, url):
        await _ready(ctx, 2)
        key = prompt_key(BODY, False, ctx.config.chunk_size, ctx.config.ring_key_chunks)
        holder = _owner(ctx, BODY)
        other = next(w.worker_id for w in workers if w.worker_id != holder)
        now = time.time()
        ctx.balancer.index.insert(key.hashes, holder, now, confirmed=True)
        # The holder has a minute of prefill queued: only blind affinity still sends work there.
        ctx.balancer.apply_report(LoadReport(holder, queued_prefill_tokens=240_000, ts=now), now)
        async with aiohttp.ClientSession() as http:
            chosen = {}
            for affinity in ("1", "0"):
                async with http.post(url + "/v1/completions", json=BODY,
                                     headers={"X-Prefixlb-Affinity": affinity}) as resp:
                    chosen[affinity] = (resp.headers["X-Prefixlb-Worker"], resp.headers["X-Prefixlb-Route-Reason"])
        assert chosen == {"1": (holder, "prefix"), "0": (other, "least_load")}


async def test_a_session_header_keeps_a_conversation_on_its_ring_position():
    async with scripted_workers("w1", "w2", "w3") as workers, \
            running_router(*[a for w in workers for a in ("--worker", w.url)]) as (ctx, url):
        await _ready(ctx, 3)
        placed = set()
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                body = {**BODY, "prompt": f"turn {i}: something unrelated to the previous turn"}
                async with http.post(url + "/v1/completions", json=body,
                                     headers={"X-Session-Id": "conversation-42"}) as resp:
                    placed.add((resp.headers["X-Prefixlb-Worker"], resp.headers["X-Prefixlb-Route-Reason"]))
        assert len(placed) == 1 and next(iter(placed))[1] == "session"


async def test_a_worker_that_joins_after_the_health_checker_stopped_gets_no_probe_loop():
    # On shutdown the checker stops before the Redis tasks, whose registry sync can still add a
    # worker: its probe loop must not start (it would outlive the router, probing on a closed session).
    async with scripted_workers("w1", "w2") as (w1, w2), \
            running_router("--worker", w1.url, "--health-interval", "0.05") as (ctx, url):
        await _ready(ctx, 1)
        await ctx.health.close()
        ctx.registry.add(w2.url, "redis", "w2")
        await asyncio.sleep(0.2)
        assert [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("probe ")] == []


async def test_a_worker_that_joins_after_pre_warming_stopped_is_not_pre_warmed():
    # On shutdown pre-warming stops before the health checker, whose probes can still admit a
    # joining worker: no pre-warm task may start then (nothing would cancel or await it).
    async with scripted_workers("w1", "w2") as (w1, w2), \
            running_router("--worker", w1.url, "--prewarm-top", "4", "--health-interval", "0.05") as (ctx, url):
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
        assert ctx.prewarmer.hot.top(1, time.time())  # a hot prefix to pre-warm with
        await ctx.prewarmer.close()
        ctx.registry.add(w2.url, "admin")
        await _ready(ctx, 2)
        await asyncio.sleep(0.1)
        assert (w2.bodies, len(ctx.prewarmer._tasks)) == ([], 0)


async def test_every_request_has_an_id_passed_on_returned_and_logged_with_its_routing(caplog):
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url) as (ctx, url):
        await _ready(ctx, 1)
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        with caplog.at_level("INFO", logger="prefixlb.router.access"):
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/completions", json=BODY, headers={"traceparent": trace}) as resp:
                    assert resp.status == 200
                    made = resp.headers["X-Request-Id"]
                async with http.post(url + "/v1/completions", json=BODY, headers={"X-Request-Id": "client-id-7"}) as resp:
                    assert resp.headers["X-Request-Id"] == "client-id-7"
                async with http.post(url + "/v1/completions", json={**BODY, "model": "nope"}) as resp:
                    assert resp.status == 404 and resp.headers.get("X-Request-Id") is None
        sent = [{k.lower(): v for k, v in h.items()} for h in worker.headers]
        assert len(made) == 32 and sent[0]["x-request-id"] == made
        assert sent[0]["traceparent"] == trace and sent[1]["x-request-id"] == "client-id-7"
        lines = [r.getMessage() for r in caplog.records if r.name == "prefixlb.router.access"]
        assert len(lines) == 2  # the 404 was refused before routing: no access line of the proxy's
        assert f"request_id={made} model=m path=/v1/completions stream=False status=200 worker=w1" in lines[0]
        assert "prompt_tokens=40 cached_tokens=" in lines[0] and "ttfb_ms=" in lines[0]
        text = ctx.metrics.render().decode()
        assert 'prefixlb_router_time_to_first_byte_seconds_count{model="m"} 2.0' in text
        assert 'prefixlb_router_request_duration_seconds_count{model="m"} 2.0' in text


async def test_ready_says_whether_the_router_can_route_while_health_stays_alive():
    async with scripted_workers("w1") as (worker,), running_router("--worker", worker.url,
                                                                   "--health-interval", "0.1") as (ctx, url):
        await _ready(ctx, 1)
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/ready") as resp:
                assert resp.status == 200 and (await resp.json())["routable_workers"] == 1
            async with http.get(url + "/version") as resp:
                version = (await resp.json())["version"]
            async with http.get(url + "/metrics") as resp:
                assert f'prefixlb_router_build_info{{component="router",version="{version}"}} 1.0' in await resp.text()
            ctx.registry.drain("w1")
            await _ready(ctx, 0)
            async with http.get(url + "/ready") as resp:
                assert resp.status == 503 and (await resp.json())["status"] == "no_routable_workers"
            async with http.get(url + "/health") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "no_routable_workers"


async def test_the_admin_api_adds_a_worker_of_a_kind_with_its_kv_event_sockets_and_refuses_bad_ones():
    async with running_router("--admin-token", "s3cret") as (ctx, url):
        async with aiohttp.ClientSession() as http:
            spec = {"url": "http://127.0.0.1:9", "kind": "vllm", "kv_events": "tcp://127.0.0.1:5557",
                    "kv_replay": "tcp://127.0.0.1:5558"}
            async with http.post(url + "/admin/workers", json=spec, headers=ADMIN) as resp:
                body = await resp.json()
                assert resp.status == 201 and (body["kind"], body["kv_events"]) == ("vllm", "tcp://127.0.0.1:5557")
            w = ctx.registry.get("http://127.0.0.1:9")
            assert (w.kind, w.kv_replay) == ("vllm", "tcp://127.0.0.1:5558")
            for bad, code in (({"url": "http://127.0.0.1:10", "kind": "triton"}, "invalid_worker"),
                              ({"url": "http://127.0.0.1:10", "kind": "prefixlb", "kv_events": "tcp://h:1"},
                               "invalid_worker"),
                              ({"url": "http://127.0.0.1:10", "kv_events": "tcp://*:5557"}, "invalid_worker"),
                              ({"url": "http://127.0.0.1:10", "kind": 5}, "invalid_worker"),
                              ({"url": "http://169.254.169.254:80", "kind": "vllm"}, "invalid_url")):
                async with http.post(url + "/admin/workers", json=bad, headers=ADMIN) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["code"] == code, bad
            assert ctx.registry.get("http://127.0.0.1:10") is None
