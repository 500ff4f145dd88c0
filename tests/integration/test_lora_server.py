"""A live worker serving LoRA adapters: vLLM's API shapes, the official `openai` client, 4xx edges.

One worker process (tiny model, two adapters from ``--lora``, an API key, --max-lora-rank 8) is
shared by the module; tests that load or unload adapters use names of their own.
"""
from __future__ import annotations

import re

import openai
import pytest

from tests.integration.worker_client import call, is_openai_error
from tests.lora_support import ALL_TARGETS, write_adapter
from tests.support import free_port, processes, spawn, wait_for
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The cache should remember this long shared prefix. " * 3


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    dirs = {"sql": write_adapter(root / "sql", rank=8, alpha=16, targets=ALL_TARGETS, seed=1),
            "chat": write_adapter(root / "chat", rank=4, alpha=4, targets=("q_proj", "v_proj"), seed=2),
            "extra": write_adapter(root / "extra", rank=2, alpha=4, targets=("o_proj",), seed=3),
            "big": write_adapter(root / "big", rank=16, alpha=16, seed=4),
            "pickled": write_adapter(root / "pickled", seed=5)}
    (dirs["pickled"] / "adapter_model.safetensors").rename(dirs["pickled"] / "adapter_model.bin")
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="module")
def worker(tmp_path_factory, adapter_dirs):
    port = free_port()
    args = ["worker", "--model", "tiny", "--port", str(port), "--worker-id", "lora-worker", "--kv-blocks", "512",
            "--threads", "1", "--api-key", KEY, "--lora", f"sql={adapter_dirs['sql']}",
            "--lora", f"chat={adapter_dirs['chat']}", "--max-loras", "2", "--max-lora-rank", "8"]
    with processes() as procs:
        procs.append(spawn(args, tmp_path_factory.mktemp("lora-worker"), "lora-worker", port=port, timeout=120))
        yield procs[0].url


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker + "/v1", api_key=KEY, max_retries=0, timeout=60)


def local_greedy(adapter_dir: str | None, prompt: str, n: int) -> str:
    """What the same engine code produces in-process (its parity with PEFT is tested elsewhere)."""
    engine = LLMEngine(EngineConfig(model="tiny", enable_lora=True))
    lora = engine.add_lora("x", adapter_dir) if adapter_dir else None
    engine.add_request("r", engine.tokenizer.encode(prompt, add_bos=True),
                       SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), lora=lora)
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(o.new_text for o in engine.step())
    return text


def complete(client, model, prompt=PROMPT, n=8, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


def test_models_lists_the_adapters_with_the_base_model_as_parent(client, adapter_dirs):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"tiny", "sql", "chat"}
    assert models["sql"].parent == "tiny" and models["sql"].root == adapter_dirs["sql"]
    assert models["tiny"].parent is None


def test_model_name_selects_the_adapter_and_the_answer_is_the_engines(client, adapter_dirs):
    base = complete(client, "tiny")
    sql = complete(client, "sql")
    chat = complete(client, "chat")

    assert sql.model == "sql"
    assert sql.choices[0].text == local_greedy(adapter_dirs["sql"], PROMPT, 8)
    assert chat.choices[0].text == local_greedy(adapter_dirs["chat"], PROMPT, 8)
    assert base.choices[0].text == local_greedy(None, PROMPT, 8)
    assert len({base.choices[0].text, sql.choices[0].text, chat.choices[0].text}) == 3


def test_the_lora_adapter_field_with_the_base_model_selects_the_same_adapter(client, worker):
    by_model = complete(client, "sql", prompt="lora_adapter field check")
    by_field = complete(client, "tiny", prompt="lora_adapter field check", lora_adapter="sql")
    assert by_field.choices[0].text == by_model.choices[0].text
    reply = call(worker + "/v1/completions", "POST", {"model": "tiny", "prompt": "x", "lora_adapter": "nope"},
                 headers=AUTH)
    assert reply.status == 400 and reply.json["error"]["code"] == "adapter_not_found"
    reply = call(worker + "/v1/completions", "POST", {"model": "sql", "prompt": "x", "lora_adapter": "chat"},
                 headers=AUTH)
    assert reply.status == 400 and reply.json["error"]["code"] == "adapter_not_found"


def test_an_unknown_model_is_a_404_naming_the_adapters_too(worker):
    reply = call(worker + "/v1/completions", "POST", {"model": "nope", "prompt": "x"}, headers=AUTH)
    assert reply.status == 404 and is_openai_error(reply)
    assert reply.json["error"]["code"] == "model_not_found" and "sql" in reply.json["error"]["message"]


def test_adapters_never_share_cached_prefixes_with_each_other_or_the_base_model(client):
    prompt = "Cache isolation between adapters, checked over HTTP. " * 3
    cached = [complete(client, m, prompt=prompt, n=2).usage.prompt_tokens_details.cached_tokens
              for m in ("chat", "sql", "tiny", "sql")]
    assert cached[:3] == [0, 0, 0]
    assert cached[3] == (len(prompt) + 1 - 1) // 16 * 16


def test_runtime_load_and_unload_use_vllms_shapes_behind_the_api_key(client, worker, adapter_dirs):
    body = {"lora_name": "extra", "lora_path": adapter_dirs["extra"]}
    assert call(worker + "/v1/load_lora_adapter", "POST", body).status == 401

    reply = call(worker + "/v1/load_lora_adapter", "POST", body, headers=AUTH)
    assert (reply.status, reply.raw) == (200, b"Success: LoRA adapter 'extra' added successfully.")
    assert "extra" in {m.id for m in client.models.list().data}
    assert complete(client, "extra", n=2).model == "extra"

    again = call(worker + "/v1/load_lora_adapter", "POST", body, headers=AUTH)
    assert again.status == 400 and "already been loaded" in again.json["error"]["message"]
    inplace = call(worker + "/v1/load_lora_adapter", "POST", {**body, "load_inplace": True}, headers=AUTH)
    assert inplace.status == 200

    reply = call(worker + "/v1/unload_lora_adapter", "POST", {"lora_name": "extra", "lora_int_id": 7}, headers=AUTH)
    assert (reply.status, reply.raw) == (200, b"Success: LoRA adapter 'extra' removed successfully.")
    gone = call(worker + "/v1/completions", "POST", {"model": "extra", "prompt": "x"}, headers=AUTH)
    assert gone.status == 404 and gone.json["error"]["code"] == "model_not_found"
    twice = call(worker + "/v1/unload_lora_adapter", "POST", {"lora_name": "extra"}, headers=AUTH)
    assert twice.status == 404 and twice.json["error"]["code"] == "lora_adapter_not_found"


@pytest.mark.parametrize("body,status,code", [
    ({"lora_name": "x"}, 400, None),
    ({"lora_path": "/tmp"}, 400, None),
    ({"lora_name": 5, "lora_path": "/tmp"}, 400, None),
    ({"lora_name": "x", "lora_path": "/tmp", "load_inplace": "yes"}, 400, None),
    ({"lora_name": "tiny", "lora_path": "/tmp"}, 400, "lora_adapter_conflict"),
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 404, "lora_adapter_not_found"),
    ({"lora_name": "x", "lora_path": "@pickled"}, 400, "invalid_lora_adapter"),
    ({"lora_name": "x", "lora_path": "@big"}, 400, "invalid_lora_adapter"),
])
def test_bad_load_requests_are_clear_4xx_errors(worker, adapter_dirs, body, status, code):
    if str(body.get("lora_path", "")).startswith("@"):
        body = {**body, "lora_path": adapter_dirs[body["lora_path"][1:]]}
    reply = call(worker + "/v1/load_lora_adapter", "POST", body, headers=AUTH)
    assert reply.status == status and is_openai_error(reply), reply.raw
    assert reply.json["error"]["code"] == code
    if body.get("lora_path", "").endswith("big"):
        assert "rank 16 exceeds --max-lora-rank 8" in reply.json["error"]["message"]
    if body.get("lora_path", "").endswith("pickled"):
        assert "only adapter_model.safetensors" in reply.json["error"]["message"]


def test_load_report_and_metrics_say_where_the_adapters_are(client, worker):
    complete(client, "sql", n=2)
    load = call(worker + "/load").json
    assert load["max_loras"] == 2
    assert set(load["lora_adapters"]) >= {"sql", "chat"} and len(load["lora_adapters"]["sql"]) == 16
    assert "sql" in load["lora_gpu"] and load["lora_waiting"] == {} and load["lora_running"] == {}
    assert load["lora_slot_load_s"] > 0 and load["lora_disk_load_s"] > 0

    text = call(worker + "/metrics").raw.decode()
    info = re.search(r'^vllm:lora_requests_info\{(.*)\} (\S+)$', text, re.M)
    assert info is not None, text[:2000]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    assert float(info.group(2)) > 1.7e9  # the scrape's time, as vLLM sets it
    requests = re.search(r'^prefixlb_worker_lora_requests_total\{lora_name="sql"\} (\S+)$', text, re.M)
    assert requests is not None and float(requests.group(1)) >= 1
    assert re.search(r'^prefixlb_worker_lora_loads_total\{lora_name="sql",tier="gpu"\} [1-9]', text, re.M)
    assert re.search(r'^prefixlb_worker_lora_slot_wait_seconds_total\{lora_name="chat"\} ', text, re.M)
    assert re.search(r'^prefixlb_worker_lora_slots 2\.0$', text, re.M)


def test_the_worker_refuses_to_start_with_a_bad_lora_flag(tmp_path, adapter_dirs):
    port = free_port()
    for bad, message in ((["--lora", "noequals"], "expected NAME=DIR"),
                         (["--lora", f"x={adapter_dirs['pickled']}"], "only adapter_model.safetensors")):
        with processes() as procs:
            procs.append(spawn(["worker", "--model", "tiny", "--port", str(port), *bad], tmp_path, "bad",
                               port=port, ready_path=None))
            proc = procs[0]
            wait_for(lambda: not proc.alive(), 60, what="the worker to exit")
            assert proc.popen.returncode == 2 and message in proc.output()


def test_a_simulated_worker_serves_adapters_with_the_same_api(tmp_path, adapter_dirs):
    port = free_port()
    args = ["worker", "--simulate", "--gpu", "H100-80G", "--sim-model", "llama-3-8b", "--time-scale", "100",
            "--port", str(port), "--lora", f"sql={adapter_dirs['sql']}", "--max-loras", "1"]
    with processes() as procs:
        procs.append(spawn(args, tmp_path, "sim-lora", port=port, timeout=120))
        url = procs[0].url
        models = call(url + "/v1/models").json["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("llama-3-8b", None), ("sql", "llama-3-8b")]
        reply = call(url + "/v1/completions", "POST", {"model": "sql", "prompt": "hello", "max_tokens": 4})
        assert reply.status == 200 and reply.json["model"] == "sql"
        loaded = call(url + "/v1/load_lora_adapter", "POST", {"lora_name": "chat", "lora_path": adapter_dirs["chat"]})
        assert loaded.status == 200
        # The report is the engine's latest snapshot: an idle engine refreshes it within a second.
        def report_with_chat():
            report = call(url + "/load").json
            return report if "chat" in report["lora_adapters"] else None

        load = wait_for(report_with_chat, 10, what="chat in the load report")
        assert (load["max_loras"], load["lora_gpu"], load["lora_cpu"]) == (1, ["sql"], ["chat"])
        assert load["lora_slot_load_s"] > 0
