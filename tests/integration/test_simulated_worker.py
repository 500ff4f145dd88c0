"""`prefixlb worker --simulate` over real HTTP: the same API, modelled time, the probes routers send."""
from __future__ import annotations

import re

import pytest

from tests.integration.worker_client import call, is_openai_error
from tests.support import free_port, processes, spawn
from worker.simulator.latency import LatencyModel
from worker.simulator.profiles import get_gpu, get_model
from worker.simulator.runner import SIM_TEXT

MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    port = free_port()
    args = ["worker", "--simulate", "--gpu", "H100-80G", "--sim-model", MODEL, "--time-scale", "1000",
            "--kv-blocks", "4096", "--sim-output-len", "32", "--worker-id", "sim-a", "--port", str(port)]
    with processes() as procs:
        procs.append(spawn(args, tmp_path_factory.mktemp("sim"), "sim-worker", port=port))
        yield procs[0].url


def _modelled_seconds(url: str) -> float:
    text = call(url + "/metrics").raw.decode()
    return float(re.search(r"^prefixlb_worker_sim_modelled_seconds_total (\S+)$", text, re.M).group(1))


def _complete(url: str, **body) -> dict:
    reply = call(url + "/v1/completions", "POST", {"model": MODEL, **body})
    assert reply.status == 200, reply.raw
    return reply.json


def test_completion_returns_the_deterministic_text_and_exact_usage(sim):
    body = _complete(sim, prompt="hello", max_tokens=5)
    assert body["choices"][0]["text"] == SIM_TEXT[:5].decode() == "The q"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["system_fingerprint"] == "sim-a"


def test_simulated_output_ends_with_eos_after_sim_output_len_tokens(sim):
    body = _complete(sim, prompt="eos test", max_tokens=100)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 32
    assert body["choices"][0]["text"] == SIM_TEXT[:31].decode()
    ignore = _complete(sim, prompt="eos test", max_tokens=40, ignore_eos=True)
    assert (ignore["choices"][0]["finish_reason"], ignore["usage"]["completion_tokens"]) == ("length", 40)


def test_a_repeated_prefix_reports_its_full_cached_blocks(sim):
    first = _complete(sim, prompt="p" * 300 + "alpha", max_tokens=1)
    second = _complete(sim, prompt="p" * 300 + "beta!", max_tokens=1)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # BOS + 300 shared bytes = 301 shared tokens = 18 full blocks of 16.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 288


def test_steps_take_exactly_the_latency_models_time(sim):
    model = LatencyModel(get_gpu("H100-80G"), get_model(MODEL))
    before = _modelled_seconds(sim)
    _complete(sim, prompt="q" * 1000, max_tokens=3)  # 1001 tokens: one prefill step, two decodes
    expected = model.prefill_time(1001) + model.decode_step_time(1, 1002) + model.decode_step_time(1, 1003)
    assert _modelled_seconds(sim) - before == pytest.approx(expected, rel=1e-9)


def test_streaming_chat_sends_role_content_usage_and_done(sim):
    reply = call(sim + "/v1/chat/completions", "POST", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}})
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers["x-prefixlb-worker-id"] == "sim-a"
    events = reply.sse()
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == "The"
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 3
    assert all(e["object"] == "chat.completion.chunk" and e["system_fingerprint"] == "sim-a" for e in events[:-1])


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_sglang_probes_answer_without_a_model_path(sim):
    for path in ("/get_server_info", "/server_info"):
        info = call(sim + path).json
        assert (info["model_id"], info["dp_size"], info["worker_id"]) == (MODEL, 1, "sim-a")
        assert (info["simulated"], info["gpu"], info["max_total_num_tokens"]) == (True, "H100-80G", 4096 * 16)
        assert "model_path" not in _keys(info) and "tokenizer_path" not in _keys(info)
    for path in ("/get_model_info", "/model_info"):
        info = call(sim + path).json
        assert (info["model_id"], info["is_generation"]) == (MODEL, True)
        assert "model_path" not in _keys(info)
    load = call(sim + "/get_load").json
    assert isinstance(load, list) and load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0
    health = call(sim + "/health_generate")
    assert (health.status, health.json["status"]) == (200, "ok")


def test_load_and_models_describe_this_worker(sim):
    load = call(sim + "/load").json
    assert (load["worker_id"], load["status"], load["total_blocks"], load["block_size"]) == ("sim-a", "ready", 4096, 16)
    assert load["prefill_tokens_per_s"] > 0 and load["decode_step_s"] > 0
    models = call(sim + "/v1/models").json
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_vllm_tokenize_and_render_probes_return_the_byte_tokens(sim):
    tok = call(sim + "/tokenize", "POST", {"prompt": "abc"}).json
    assert (tok["tokens"], tok["count"]) == ([256, 97, 98, 99], 4)
    assert call(sim + "/tokenize", "POST", {"prompt": "abc", "add_special_tokens": False}).json["tokens"] == [97, 98, 99]
    assert call(sim + "/detokenize", "POST", {"tokens": [97, 98, 99]}).json == {"prompt": "abc"}
    chat_tok = call(sim + "/tokenize", "POST", {"messages": [{"role": "user", "content": "x"}]}).json
    assert chat_tok["tokens"] == [256, *b"<|user|>\nx<|end|>\n<|assistant|>\n"]
    assert call(sim + "/tokenize", "POST", {"model": "nope", "prompt": "x"}).status == 404
    rendered = call(sim + "/v1/completions/render", "POST", {"model": MODEL, "prompt": "abc"}).json
    assert rendered[0]["token_ids"] == [256, 97, 98, 99]
    chat = call(sim + "/v1/chat/completions/render", "POST",
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).json
    assert chat["token_ids"] == [256, *b"<|user|>\nx<|end|>\n<|assistant|>\n"]


def test_every_answer_names_the_worker_even_errors(sim):
    for reply in (call(sim + "/health"), call(sim + "/nowhere"),
                  call(sim + "/v1/completions", "POST", {"model": "other", "prompt": "x"})):
        assert reply.headers["x-prefixlb-worker-id"] == "sim-a"
    missing = call(sim + "/nowhere")
    assert missing.status == 404 and is_openai_error(missing)


def test_metrics_expose_cache_blocks_queues_and_latency(sim):
    _complete(sim, prompt="metrics", max_tokens=2)
    text = call(sim + "/metrics").raw.decode()
    for name in ("prefixlb_worker_prefix_cache_queried_tokens_total", "prefixlb_worker_prefix_cache_hit_tokens_total",
                 "prefixlb_worker_kv_blocks_used", "prefixlb_worker_kv_blocks_free", "prefixlb_worker_kv_blocks_cached",
                 "prefixlb_worker_requests_running", "prefixlb_worker_requests_waiting",
                 "prefixlb_worker_preemptions_total", "prefixlb_worker_prompt_tokens_total",
                 "prefixlb_worker_generation_tokens_total", "prefixlb_worker_time_to_first_token_seconds_bucket",
                 "prefixlb_worker_inter_token_latency_seconds_bucket"):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? ", text, re.M), name
    assert re.search(r'^prefixlb_worker_requests_total\{endpoint="completions",finish_reason="length"\} [1-9]', text, re.M)
