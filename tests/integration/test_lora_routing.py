"""Adapter-aware routing over real processes: a router in front of three simulated workers serving
the same two PEFT adapters with one GPU slot each; the official `openai` client as the client.

A request for an adapter goes to the worker that has it in a GPU slot (even when that is not the
adapter's consistent-hash home, and whatever its prompt's own ring position); an adapter no worker
has in a slot goes to its home; the router's per-adapter metrics count requests and the loads
they caused.
"""
from __future__ import annotations

import re

import openai
import pytest

from router.routing.adapters import adapter_ring_key
from router.routing.ring import WorkerRing
from tests.integration.worker_client import call
from tests.lora_support import ALL_TARGETS, write_adapter
from tests.support import free_port, processes, spawn, wait_for

WORKER_IDS = ("lw0", "lw1", "lw2")


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of ``name`` with exactly ``labels`` in Prometheus text, or None."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)\{(.*)\} (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted(m.group(2).split(","))) == want:
            return float(m.group(3))
    return None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-routing")
    sql = write_adapter(root / "sql", rank=8, alpha=16, targets=ALL_TARGETS, seed=1)
    chat = write_adapter(root / "chat", rank=4, alpha=4, targets=("q_proj", "v_proj"), seed=2)
    ports = [free_port() for _ in WORKER_IDS]
    rport = free_port()
    with processes() as procs:
        for worker_id, port in zip(WORKER_IDS, ports):
            procs.append(spawn(["worker", "--simulate", "--gpu", "H100-80G", "--sim-model", "llama-3-8b",
                                "--time-scale", "100", "--port", str(port), "--worker-id", worker_id,
                                "--lora", f"sql={sql}", "--lora", f"chat={chat}", "--max-loras", "1",
                                "--log-level", "warning"], root, worker_id, port=port, timeout=120))
        procs.append(spawn(["router", "--port", str(rport), *(a for p in ports for a in ("--worker", f"http://127.0.0.1:{p}")),
                            "--health-interval", "0.1", "--log-level", "warning"], root, "router", port=rport))
        router = procs[-1].url
        wait_for(lambda: call(router + "/health").json["routable_workers"] == 3, 30, what="three routable workers")
        yield router, dict(zip(WORKER_IDS, (p.url for p in procs)))


def home_of(adapter: str) -> str:
    return WorkerRing(WORKER_IDS).owner(adapter_ring_key(adapter))


def routed_to(client: openai.OpenAI, model: str, prompt: str) -> str:
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=4)
    assert raw.parse().model == model
    return raw.headers["X-Prefixlb-Worker"]


def test_requests_for_an_adapter_go_where_it_is_loaded_and_a_cold_one_goes_to_its_home(fleet):
    router, workers = fleet
    holder = next(w for w in WORKER_IDS if w != home_of("sql"))
    # Put sql in the holder's only GPU slot, behind the router's back.
    reply = call(workers[holder] + "/v1/completions", "POST", {"model": "sql", "prompt": "warm up", "max_tokens": 2})
    assert reply.status == 200
    wait_for(lambda: metric(call(router + "/metrics").raw.decode(), "prefixlb_router_lora_adapter_workers",
                            adapter="sql", tier="gpu") == 1.0, 15, what="the router to see sql in a GPU slot")
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60)
    # Different prompts: by their prefixes alone they would spread over the ring.
    chosen = [routed_to(client, "sql", f"question number {i} about the orders table") for i in range(6)]
    assert chosen == [holder] * 6

    # chat is in host memory on every worker and in no slot: its home loads it, and keeps it.
    chosen = [routed_to(client, "chat", f"hello there, friend number {i}") for i in range(4)]
    assert chosen == [home_of("chat")] * 4

    text = call(router + "/metrics").raw.decode()
    assert metric(text, "prefixlb_router_lora_requests_total", adapter="sql") == 6
    assert metric(text, "prefixlb_router_lora_loads_total", adapter="sql", tier="cpu") == 0
    assert metric(text, "prefixlb_router_lora_requests_total", adapter="chat") == 4
    assert metric(text, "prefixlb_router_lora_loads_total", adapter="chat", tier="cpu") == 1
    assert metric(text, "prefixlb_router_lora_loads_total", adapter="chat", tier="disk") == 0


def test_an_adapter_a_worker_loads_at_run_time_becomes_a_model_the_router_sends_only_there(fleet, tmp_path):
    router, workers = fleet
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql2", prompt="hi", max_tokens=2)
    only = WORKER_IDS[0]
    path = write_adapter(tmp_path / "sql2", rank=2, alpha=4, targets=("o_proj",), seed=7)
    loaded = call(workers[only] + "/v1/load_lora_adapter", "POST", {"lora_name": "sql2", "lora_path": str(path)})
    assert loaded.status == 200
    wait_for(lambda: "sql2" in [m["id"] for m in call(router + "/v1/models").json["data"]], 15,
             what="sql2 among the router's models")
    assert [routed_to(client, "sql2", f"runtime {i}") for i in range(3)] == [only] * 3
