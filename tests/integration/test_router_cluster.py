"""A real cluster: 4 tiny-engine workers and 2 routers as processes, sharing a real Redis.

Workers register themselves and publish their KV events; routers learn everything through Redis
(no ``--worker`` flags). The official ``openai`` client talks to the routers.

Prediction tolerance (block granularity): the router predicts whole KV blocks up to the end of
the last chunk (128 bytes) it saw matched, so ``predicted <= reported < predicted + one chunk's
tokens + one block``: a worker may also hold the bytes past the last full chunk (an exact repeat)
and, for chat, its template shifts token positions against the router's rendering. For
completions sharing whole chunks and then differing (the byte-level tokenizer, one BOS token)
the prediction is exact, and the tests below assert equality there.
"""
from __future__ import annotations

import re

import openai
import pytest

from protocol import render_chat
from tests.integration.worker_client import call
from tests.support import Proc, free_port, spawn, wait_for

BLOCK = 16


def document(word: str) -> str:
    """2,048 bytes (16 chunks of 128 bytes exactly) of a contract whose articles are ``word``."""
    return "".join(f"{word} {i}: the supplier delivers the goods within thirty days of the order. "
                   for i in range(40))[:2048]


DOC = document("Article")


@pytest.fixture(scope="module")
def prefix(module_redis_prefix):
    return module_redis_prefix


def _router_args(redis_url: str, prefix: str, port: int) -> list[str]:
    return ["router", "--port", str(port), "--redis", redis_url, "--redis-prefix", prefix,
            "--registry-interval", "0.2", "--health-interval", "0.5", "--snapshot-interval", "1",
            "--admin-token", "s3cret", "--log-level", "warning"]


def _routable(router: Proc, n: int) -> bool:
    reply = call(router.url + "/health", timeout=2)
    return reply.status == 200 and reply.json["routable_workers"] == n


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_server_url, prefix):
    """4 tiny workers + 2 routers; yields (workers, routers, start_router)."""
    logs = tmp_path_factory.mktemp("cluster")
    procs: list[Proc] = []
    try:
        workers = []
        for i in range(4):
            port = free_port()
            workers.append(spawn(["worker", "--model", "tiny", "--port", str(port), "--worker-id", f"w{i}",
                                  "--redis", redis_server_url, "--redis-prefix", prefix,
                                  "--advertise", f"http://127.0.0.1:{port}", "--heartbeat-interval", "0.2",
                                  "--log-level", "warning"],
                                 logs, f"worker{i}", port, ready_path=None))
            procs.append(workers[-1])
        for w in workers:
            wait_for(lambda: not w.alive() or call(w.url + "/health", timeout=2).status == 200, 120,
                     what=f"{w.url} healthy")
            assert w.alive(), w.output()[-3000:]

        def start_router(name: str) -> Proc:
            port = free_port()
            proc = spawn(_router_args(redis_server_url, prefix, port), logs, name, port)
            procs.append(proc)
            wait_for(lambda: _routable(proc, 4), 30, what=f"{name} to route to 4 workers")
            return proc

        routers = [start_router("router1"), start_router("router2")]
        yield workers, routers, start_router
    finally:
        for p in procs:
            p.stop()


def complete(router: Proc, prompt: str, **extra):
    reply = call(router.url + "/v1/completions", "POST",
                 {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}, timeout=120)
    assert reply.status == 200, reply.raw[:500]
    usage = reply.json["usage"]
    return (reply.headers["x-prefixlb-worker"], reply.headers["x-prefixlb-route-reason"],
            int(reply.headers["x-prefixlb-predicted-cached-tokens"]), usage["prompt_tokens_details"]["cached_tokens"])


def stored_events(router: Proc) -> float:
    text = call(router.url + "/metrics").raw.decode()
    found = re.search(r'^prefixlb_router_kv_events_total\{kind="stored"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_requests_sharing_a_prefix_land_on_one_worker_from_either_router(cluster):
    _, (r1, r2), _ = cluster
    placed = []
    for i, router in enumerate((r1, r2, r1, r2)):
        worker, reason, _, _ = complete(router, DOC + f" Question {i}: when is delivery due?")
        placed.append(worker)
        if i == 0:
            assert reason == "ring"  # a new prefix: both routers place it by the ring
            wait_for(lambda: stored_events(r2) > 0, 10, what="router2 to apply the worker's KV events")
        else:
            assert reason == "prefix"
    assert len(set(placed)) == 1, placed


def test_cached_tokens_reported_by_workers_match_the_routers_predictions(cluster):
    _, (r1, r2), _ = cluster
    doc = document("Clause")
    before = stored_events(r2)
    worker, _, predicted, cached = complete(r1, doc + " First question: who pays for shipping?")
    assert (predicted, cached) == (0, 0)
    wait_for(lambda: stored_events(r2) > before, 10, what="router2 to see the stored blocks")
    for router, question in ((r1, " Why must the buyer inspect the goods?"), (r2, " How are disputes settled?")):
        again, reason, predicted, cached = complete(router, doc + question)
        # 16 shared chunks = 2,048 bytes = BOS + 2,047 bytes in 128 full blocks, as predicted
        # (the 2,048th byte shares block 128 with the differing question).
        assert (again, reason, predicted, cached) == (worker, "prefix", 2048, 2048)


def test_a_router_started_later_routes_known_prefixes_to_the_same_worker_from_its_first_request(cluster):
    _, (r1, _), start_router = cluster
    doc = document("Section")
    worker, _, _, _ = complete(r1, doc + " Is there a penalty for late delivery?")
    r3 = start_router("router3")
    again, reason, predicted, cached = complete(r3, doc + " What if the goods are damaged?")
    assert (again, reason) == (worker, "prefix")
    assert predicted == cached == 2048


def test_the_openai_client_works_through_the_router_streaming_included(cluster):
    _, (r1, _), _ = cluster
    client = openai.OpenAI(base_url=r1.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt=DOC + " Summary:", max_tokens=3, temperature=0)
    assert completion.usage.prompt_tokens == len(DOC + " Summary:") + 1
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "Summarise article 3."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                                    temperature=0, stream=True)
        if chunk.choices)
    assert text == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens == chat.usage.prompt_tokens
    # A repeat hits the cache; the router saw 16 of its chunks, the worker also holds the tail.
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=1)
    predicted = int(raw.headers["x-prefixlb-predicted-cached-tokens"])
    cached = raw.parse().usage.prompt_tokens_details.cached_tokens
    chunk_tokens = 128 * usage.prompt_tokens / len(render_chat(messages))
    assert 0 < predicted <= cached < predicted + chunk_tokens + BLOCK, (predicted, cached)


def test_affinity_set_on_one_router_reaches_the_other(cluster):
    _, (r1, r2), _ = cluster
    admin = {"Authorization": "Bearer s3cret"}
    try:
        reply = call(r1.url + "/admin/config", "PUT", {"affinity": 0.35}, headers=admin)
        assert reply.json == {"runtime": {"affinity": 0.35, "policy": "cache_aware", "prewarm_top": 0}, "shared": True}
        wait_for(lambda: call(r2.url + "/admin/config", headers=admin).json["runtime"]["affinity"] == 0.35, 10,
                 what="router2 to adopt the affinity")
    finally:
        call(r1.url + "/admin/config", "PUT", {"affinity": 0.8}, headers=admin)
