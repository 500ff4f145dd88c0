"""prefixlb's router in front of two real vLLM 0.32 servers (tests/vllm_support.py), unchanged.

- kinds: unmodified vLLM servers are detected (no ``--worker vllm=``), probed on ``/health``,
  their load read from ``/metrics``, their models and ``max_model_len`` from ``/v1/models``;
- approximate routing: requests sharing a prefix stay on one server and vLLM itself reports
  the hits (``cached_tokens``);
- precise routing: with ``kv-events`` and the checkpoint's tokenizer, the router's predicted
  cached tokens equal what vLLM reports on multi-turn chats;
- streaming through the router with the official ``openai`` client;
- ``kill -9`` of one server under load fails no request that had not started streaming, drops
  what the router knew of its cache, and its restart (an empty cache) is not predicted to hit.

The servers are shared by the whole run: every test uses prompts of its own (a unique tag).
The kill test restarts the server it killed, at the same addresses, before it ends.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections import defaultdict

import openai
import pytest

from tests.integration.worker_client import call
from tests.support import free_port, spawn, wait_for
from tests.vllm_support import BLOCK_SIZE, MODEL_NAME, START_TIMEOUT_S, start_server

pytestmark = pytest.mark.timeout(900)

ADMIN = {"Authorization": "Bearer admin-t0ken"}


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _start_router(tmp_path_factory, fleet, name: str, precise: bool):
    port = free_port()
    args = ["router", "--port", str(port), "--admin-token", ADMIN["Authorization"].split()[1],
            "--health-interval", "0.5", "--health-timeout", "5", "--retry-deadline", "60"]
    for server in fleet.servers:
        spec = server.url
        if precise:
            spec = f"vllm={server.url},kv-events={server.kv_endpoint},kv-replay={server.replay_endpoint}"
        args += ["--worker", spec]
    if precise:
        args += ["--tokenizer", f"{MODEL_NAME}={fleet.checkpoint}"]
    router = spawn(args, tmp_path_factory.mktemp(name), name, port=port, timeout=60)
    wait_for(lambda: call(router.url + "/health").json["routable_workers"] == len(fleet.servers), 60,
             what="every vLLM server routable")
    return router


@pytest.fixture(scope="module")
def router(vllm_fleet, tmp_path_factory):
    """A router told nothing but the servers' URLs (approximate: cached_tokens feedback)."""
    proc = _start_router(tmp_path_factory, vllm_fleet, "router", precise=False)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def precise_router(vllm_fleet, tmp_path_factory):
    """A router reading both servers' KV events, with the checkpoint's tokenizer."""
    proc = _start_router(tmp_path_factory, vllm_fleet, "precise-router", precise=True)
    yield proc
    proc.stop()


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(router, prompt: str, max_tokens: int = 2) -> tuple[str, int, int]:
    """(worker, predicted cached tokens, vLLM's cached tokens) of one completion via the router."""
    raw = _client(router).completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt,
                                                                max_tokens=max_tokens, temperature=0)
    answer = raw.parse()
    return (raw.headers["x-prefixlb-worker"], int(raw.headers["x-prefixlb-predicted-cached-tokens"]),
            answer.usage.prompt_tokens_details.cached_tokens)


def _workers(router) -> dict[str, dict]:
    return {w["url"]: w for w in call(router.url + "/admin/workers", headers=ADMIN).json["workers"]}


# ---- kinds, probes, load ---------------------------------------------------------------------------
def test_unmodified_vllm_servers_are_detected_and_their_load_read_from_their_metrics(router, vllm_fleet):
    workers = wait_for(lambda: (ws := _workers(router)) and all(w["load_source"] == "metrics" for w in ws.values())
                       and ws, 30, what="load read from /metrics")
    assert sorted(workers) == sorted(s.url for s in vllm_fleet.servers)
    for w in workers.values():
        assert (w["kind"], w["state"], w["models"]) == ("vllm", "healthy", [MODEL_NAME])
        assert w["max_model_len"] == {MODEL_NAME: 4096}
    health = call(router.url + "/health").json
    assert (health["status"], health["routable_workers"]) == ("ok", 2)
    metrics = call(router.url + "/metrics").raw.decode()
    for server in vllm_fleet.servers:
        worker_id = server.url.split("://")[1]
        assert f'prefixlb_router_worker_load_source{{kind="vllm",source="metrics",worker="{worker_id}"}} 1.0' in metrics


def test_a_server_told_to_be_vllm_that_is_not_reachable_is_unhealthy_and_health_says_so(tmp_path_factory):
    port, dead = free_port(), free_port()
    proc = spawn(["router", "--port", str(port), "--worker", f"vllm=http://127.0.0.1:{dead}"],
                 tmp_path_factory.mktemp("dead"), "router-dead", port=port)
    try:
        health = wait_for(lambda: (h := call(proc.url + "/health").json)["status"] != "ok" and h, 30,
                          what="/health to say no worker is routable")
        assert health["status"] == "no_routable_workers" and health["routable_workers"] == 0
        reply = call(proc.url + "/v1/completions", "POST", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        assert reply.status == 503 and reply.json["error"]["code"] == "no_workers"
    finally:
        proc.stop()


# ---- approximate: cached_tokens feedback -----------------------------------------------------------
def test_prefix_groups_stay_on_one_vllm_server_and_vllm_reports_the_hits(router):
    tag = _tag()
    groups = {g: f"[{tag} group {g}] " + f"Shared context number {g}: the quick brown fox. " * 12 for g in range(4)}
    placed: dict[int, set[str]] = defaultdict(set)
    hits = []
    for rnd in range(4):
        for g, prefix in groups.items():
            worker, _, cached = _complete(router, prefix + f" question {rnd}?")
            placed[g].add(worker)
            if rnd:
                hits.append(cached)
    assert all(len(ws) == 1 for ws in placed.values()), placed
    # every repeat finds at least the shared prefix's full blocks (~600 bytes -> 4 blocks of 128)
    assert min(hits) >= 4 * BLOCK_SIZE, hits


def test_streaming_through_the_router_works_with_the_openai_client(router):
    client = _client(router)
    tag = _tag()
    messages = [{"role": "user", "content": f"[{tag}] Tell me about prefix caching. " * 8}]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks and all(c.usage is None for c in chunks)  # the router's usage chunk is not passed on
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    assert streamed == whole.choices[0].message.content and streamed
    with_usage = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    assert with_usage[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert with_usage[-1].usage.prompt_tokens_details.cached_tokens >= 2 * BLOCK_SIZE


# ---- precise: vLLM's KV events -----------------------------------------------------------------------
def _chat(router, messages, max_tokens: int = 8) -> tuple[str, int, int, str]:
    raw = _client(router).chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages,
                                                                     max_tokens=max_tokens, temperature=0)
    answer = raw.parse()
    return (raw.headers["x-prefixlb-worker"], int(raw.headers["x-prefixlb-predicted-cached-tokens"]),
            answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].message.content)


def test_precise_predictions_equal_the_cached_tokens_vllm_reports_on_multi_turn_chats(precise_router, vllm_fleet):
    wait_for(lambda: _synchronised(precise_router) == [1.0, 1.0], 60,
             what="both servers' KV-event streams synchronised")
    tag = _tag()
    results = []
    conversations = {c: [{"role": "system", "content": f"[{tag} conv {c}] You are assistant {c}; answer briefly. " * 6}]
                     for c in range(4)}
    for turn in range(5):
        for c, history in conversations.items():
            history.append({"role": "user", "content": f"Turn {turn} of conversation {c}: and then? " * 3})
            worker, predicted, reported, content = _chat(precise_router, history)
            results.append((c, turn, worker, predicted, reported))
            history.append({"role": "assistant", "content": content})
    exact = sum(1 for *_, p, r in results if p == r)
    assert exact / len(results) >= 0.99, [r for r in results if r[3] != r[4]]
    later = [r for r in results if r[1] > 0]
    assert all(r[4] >= BLOCK_SIZE for r in later)  # every later turn hit its history...
    by_conv = defaultdict(set)
    for c, _, worker, *_ in results:
        by_conv[c].add(worker)
    assert all(len(ws) == 1 for ws in by_conv.values())  # ...on the one server that holds it


def _synchronised(router) -> list[float]:
    """``prefixlb_router_kv_events_synchronised`` of every backend, in order."""
    return [float(line.rsplit(" ", 1)[1]) for line in call(router.url + "/metrics").raw.decode().splitlines()
            if line.startswith("prefixlb_router_kv_events_synchronised{")]


def _victim_blocks(router, worker_id: str) -> float:
    for line in call(router.url + "/metrics").raw.decode().splitlines():
        if line.startswith(f'prefixlb_router_kv_events_blocks{{worker="{worker_id}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- a replica dies -----------------------------------------------------------------------------------
def test_kill_9_of_a_vllm_server_under_load_fails_no_request_and_its_restart_is_not_predicted_to_hit(
        precise_router, vllm_fleet):
    victim = vllm_fleet.servers[1]
    victim_id = victim.url.split("://")[1]
    tag = _tag()
    # a prefix only the victim holds: computed there directly, then known to the router from the
    # victim's own KV events
    prefix = f"[{tag}] A long shared document about paged attention and prefix caching. " * 10
    before = _victim_blocks(precise_router, victim_id)
    openai.OpenAI(base_url=victim.url + "/v1", api_key="unused", max_retries=0, timeout=120).completions.create(
        model=MODEL_NAME, prompt=prefix, max_tokens=1, temperature=0)
    # its BlockStored events reach the router a moment after the answer: wait for them
    wait_for(lambda: _victim_blocks(precise_router, victim_id) >= before + 4, 30, what="the victim's KV events")
    owner, predicted, reported = _complete(precise_router, f"{prefix} (probe)")
    assert owner == victim_id and predicted == reported >= 4 * BLOCK_SIZE
    errors: list[str] = []
    done = []
    stop = threading.Event()

    def load(n: int) -> None:
        client = _client(precise_router)
        k = 0
        while not stop.is_set():
            try:
                client.completions.create(model=MODEL_NAME, prompt=f"{prefix} load {n}.{k}", max_tokens=16,
                                          temperature=0)
                done.append(1)
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                errors.append(repr(exc))
            k += 1

    threads = [threading.Thread(target=load, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(done) >= 8, 120, what="load flowing")
        os.killpg(victim.popen.pid, signal.SIGKILL)  # the API server, its engine core and worker
        victim.popen.wait(30)
        sent_at_kill = len(done)
        wait_for(lambda: len(done) >= sent_at_kill + 12, 120, what="requests served after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    assert errors == []
    workers = _workers(precise_router)
    assert workers[victim.url]["state"] == "unhealthy"
    metrics = call(precise_router.url + "/metrics").raw.decode()
    assert f'prefixlb_router_kv_events_blocks{{worker="{victim_id}"}} 0.0' in metrics
    assert f'prefixlb_router_kv_events_synchronised{{worker="{victim_id}"}} 0.0' in metrics

    # the restart: same addresses, an empty cache
    restarted = start_server(vllm_fleet.checkpoint, victim.name + "-restarted", victim.log.parent, cpu=1,
                             same_as=victim)
    vllm_fleet.servers[1] = restarted
    restarted.wait_ready(time.monotonic() + START_TIMEOUT_S)
    wait_for(lambda: _workers(precise_router)[victim.url]["state"] == "healthy", 120, what="the victim healthy again")
    for i in range(6):
        worker, predicted, reported = _complete(precise_router, f"{prefix} after restart {i}")
        assert predicted == reported, (i, worker, predicted, reported)

