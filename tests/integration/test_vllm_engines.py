"""Real vLLM 0.32 servers (tests/vllm_support.py) against prefixlb's own pieces.

- the checkpoint `prefixlb model save` writes is served by vLLM and by prefixlb's worker with
  the same tokens and the same greedy outputs (logprobs within 1e-5);
- what vLLM answers on its probes and how its ``cached_tokens`` counts (full 128-token blocks,
  never the last prompt token);
- its Prometheus text read by router/fleet/engine_metrics.py;
- its ZMQ KV events decoded and indexed by router/routing/token_index.py, whose predictions
  equal the ``cached_tokens`` vLLM then reports;
- chats rendered to token ids by router/routing/chat_tokens.py exactly as vLLM renders them.

The servers are shared by the whole run, so every test uses prompts of its own (a unique tag
first) and never assumes an empty cache.
"""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from router.fleet.engine_metrics import VLLM, load_report, parse_engine_metrics
from router.routing.chat_tokens import BackendTokenizer
from router.routing.token_index import Applied, SyncState, TokenBlockIndex
from router.routing.vllm_kv_events import BlockStored, decode_frames, replay_request
from tests.support import free_port, spawn, wait_for
from tests.vllm_support import BLOCK_SIZE, MODEL_NAME, get_json, get_text, post_json

pytestmark = pytest.mark.timeout(900)

LOGPROB_ATOL = 1e-5


def _same_text(vllm_text: str, worker_text: str) -> bool:
    """Equal, except where an output stops inside a UTF-8 character: prefixlb's worker ends it
    with U+FFFD, vLLM leaves the incomplete character out."""
    return vllm_text.rstrip("\ufffd") == worker_text.rstrip("\ufffd")


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _completion(url: str, prompt, max_tokens: int = 16, **kw) -> dict:
    return post_json(url + "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, **kw})


def _chat(url: str, messages, max_tokens: int = 16, **kw) -> dict:
    return post_json(url + "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages,
                                                    "max_tokens": max_tokens, "temperature": 0, **kw})


@pytest.fixture(scope="module")
def vllm(vllm_fleet):
    return vllm_fleet.servers[0]


@pytest.fixture(scope="module")
def worker(vllm_fleet, tmp_path_factory):
    """prefixlb's own worker on the very checkpoint vLLM serves."""
    port = free_port()
    proc = spawn(["worker", "--model", str(vllm_fleet.checkpoint), "--served-model-name", MODEL_NAME,
                  "--port", str(port), "--block-size", "16"],
                 tmp_path_factory.mktemp("worker-logs"), "worker", port=port, timeout=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def backend_tokenizer(vllm_fleet) -> BackendTokenizer:
    ckpt = vllm_fleet.checkpoint
    return BackendTokenizer.from_files((ckpt / "tokenizer.json").read_text(),
                                       json.loads((ckpt / "tokenizer_config.json").read_text()))


# ---- the checkpoint: same tokens, same greedy outputs ---------------------------------------------
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. " * 4,
           "Grüße, 世界! 👋 naïve café", "x"]


def test_vllm_and_the_prefixlb_worker_tokenize_the_saved_checkpoint_identically(vllm, worker):
    for prompt in PROMPTS:
        v = post_json(vllm.url + "/tokenize", {"model": MODEL_NAME, "prompt": prompt})
        w = post_json(worker.url + "/tokenize", {"model": MODEL_NAME, "prompt": prompt})
        assert v["tokens"] == w["tokens"] == [256, *prompt.encode()]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completions_are_identical_in_vllm_and_the_prefixlb_worker(vllm, worker, prompt):
    v = _completion(vllm.url, prompt, max_tokens=24, logprobs=1, ignore_eos=True)
    w = _completion(worker.url, prompt, max_tokens=24, logprobs=1, ignore_eos=True)
    assert _same_text(v["choices"][0]["text"], w["choices"][0]["text"])
    v_lp = v["choices"][0]["logprobs"]["token_logprobs"]
    w_lp = w["choices"][0]["logprobs"]["token_logprobs"]
    assert len(v_lp) == len(w_lp) == 24
    assert max(abs(a - b) for a, b in zip(v_lp, w_lp)) < LOGPROB_ATOL
    assert v["usage"]["prompt_tokens"] == w["usage"]["prompt_tokens"] == len(prompt.encode()) + 1


CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"},
     {"role": "assistant", "content": "Stored keys and values."}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_greedy_chats_are_identical_in_vllm_and_the_prefixlb_worker(vllm, worker, messages):
    v = _chat(vllm.url, messages, max_tokens=16, logprobs=True, return_token_ids=True, ignore_eos=True)
    w = _chat(worker.url, messages, max_tokens=16, logprobs=True, ignore_eos=True)
    assert v["usage"]["prompt_tokens"] == w["usage"]["prompt_tokens"]
    v_content = v["choices"][0]["logprobs"]["content"]
    w_content = w["choices"][0]["logprobs"]["content"]
    # vLLM spells a token that is part of a longer UTF-8 character as "" with no bytes, but
    # returns exact ids; the worker gives each token's bytes (the byte vocabulary's id is its
    # byte; BOS/EOS have none). EOS may be generated: ignore_eos only keeps decoding past it.
    v_ids = v["choices"][0]["token_ids"]
    assert len(v_ids) == len(w_content) == 16
    assert [t for t in v_ids if t < 256] == [b for item in w_content for b in item["bytes"]]
    assert [i for i, t in enumerate(v_ids) if t >= 256] == [i for i, item in enumerate(w_content) if not item["bytes"]]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(v_content, w_content)) < LOGPROB_ATOL
    assert _same_text(v["choices"][0]["message"]["content"], w["choices"][0]["message"]["content"])


# ---- probes and cached_tokens ------------------------------------------------------------------
def test_vllm_answers_health_models_load_and_version_as_documented(vllm):
    assert get_text(vllm.url + "/health") == ""
    models = get_json(vllm.url + "/v1/models")
    assert [(m["id"], m["max_model_len"], m["owned_by"]) for m in models["data"]] == [(MODEL_NAME, 4096, "vllm")]
    assert get_json(vllm.url + "/load") == {"server_load": 0}
    assert get_json(vllm.url + "/version") == {"version": "0.32.0"}


def test_cached_tokens_count_full_blocks_and_never_the_last_prompt_token(vllm):
    tag = _tag()
    seen = {}
    for n in (128, 129, 256, 257, 300):
        prompt = (f"{tag}-{n}-" + "#" * n)[:n - 1]  # n tokens with BOS, a first block of its own
        first = _completion(vllm.url, prompt, max_tokens=1)["usage"]
        again = _completion(vllm.url, prompt, max_tokens=1)["usage"]
        assert (first["prompt_tokens"], first["prompt_tokens_details"]["cached_tokens"]) == (n, 0)
        seen[n] = again["prompt_tokens_details"]["cached_tokens"]
    assert seen == {128: 0, 129: 128, 256: 128, 257: 256, 300: 256}


# ---- Prometheus metrics -> LoadReport ------------------------------------------------------------
def test_vllm_metrics_become_a_load_report_with_measured_speeds(vllm):
    before = parse_engine_metrics(get_text(vllm.url + "/metrics"), ts=time.time())
    assert (before.kind, before.block_size, before.models) == (VLLM, BLOCK_SIZE, (MODEL_NAME,))
    assert before.total_blocks and before.capacity_tokens == before.total_blocks * BLOCK_SIZE
    tag = _tag()
    stop, done = threading.Event(), [0] * 6

    def keep_sending(i: int) -> None:  # until a scrape has seen requests running
        while not stop.is_set():
            _completion(vllm.url, f"{tag}-{i}-{done[i]} " + "m" * 300, max_tokens=64, ignore_eos=True)
            done[i] += 1

    threads = [threading.Thread(target=keep_sending, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        busy = wait_for(lambda: (s := parse_engine_metrics(get_text(vllm.url + "/metrics"), time.time())).running > 0
                        and s, timeout=120, interval=0.02, what="vLLM reporting running requests")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    after = wait_for(lambda: (s := parse_engine_metrics(get_text(vllm.url + "/metrics"), time.time())).running == 0
                     and s, timeout=60, what="vLLM idle again")
    assert busy.running + busy.waiting >= 1 and busy.kv_usage > 0
    sent = sum(done)
    assert after.generation_tokens_total - before.generation_tokens_total >= sent * 64
    assert after.prompt_tokens_total - before.prompt_tokens_total >= sent * (len(tag) + 305)
    report = load_report("vllm-0", after, before)
    assert report.running == 0 and report.block_size == BLOCK_SIZE
    assert report.prefill_tokens_per_s > 0 and 0 < report.decode_step_s < 5


# ---- KV events -> token index -------------------------------------------------------------------
def _replay(server, start_seq: int = 0, timeout_s: float = 10.0) -> list:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.connect(server.replay_endpoint)
    try:
        sock.send_multipart(replay_request(start_seq))
        batches = []
        while True:
            frames = sock.recv_multipart()
            topic, batch = decode_frames(frames[1:])
            if batch is None:
                return batches
            assert topic == "kv"
            batches.append(batch)
    finally:
        sock.close()


def test_the_replayed_event_history_predicts_the_cached_tokens_vllm_reports(vllm, backend_tokenizer):
    tag = _tag()
    shared = f"[{tag}] You are a patient tutor who answers in full sentences. " * 5
    history = [{"role": "system", "content": shared}]
    predicted, reported = [], []
    for turn in range(4):
        history.append({"role": "user", "content": f"Question {turn}: what comes after {turn}? " * 3})
        index = TokenBlockIndex()
        assert index.resynchronise("vllm-0", _replay(vllm))
        assert index.state("vllm-0") is SyncState.SYNCHRONISED and index.block_size("vllm-0") == BLOCK_SIZE
        ids = backend_tokenizer.chat_token_ids(history)
        predicted.append(index.predicted_cached_tokens("vllm-0", ids))
        answer = _chat(vllm.url, history, max_tokens=8, return_token_ids=True)
        assert answer["prompt_token_ids"] == ids
        reported.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    assert predicted == reported
    assert reported[0] == 0 and all(r >= BLOCK_SIZE for r in reported[1:])


def test_live_kv_events_arrive_in_sequence_and_a_missed_batch_drops_the_backend(vllm):
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(vllm.kv_endpoint)
    try:
        tag = _tag()
        live = []

        def one_stored_batch() -> bool:
            # PUB/SUB drops what is sent before the subscription is up: keep sending until one lands.
            _completion(vllm.url, f"{tag} live " + "q" * 140, max_tokens=1)
            while sub.poll(200):
                _, batch = decode_frames(sub.recv_multipart())
                live.append(batch)
            return any(isinstance(e, BlockStored) for b in live for e in b.events)

        wait_for(one_stored_batch, timeout=60, interval=0.1, what="a BlockStored batch on the SUB socket")
        seqs = [b.seq for b in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        index = TokenBlockIndex()
        results = [index.apply("vllm-0", b) for b in live]
        assert set(results) == {Applied.APPLIED}
        # joined late: what it holds is right, but it may not be everything
        assert index.state("vllm-0") is (SyncState.SYNCHRONISED if seqs[0] == 0 else SyncState.UNSYNCHRONISED)
        prompt_ids = [256, *f"{tag} live ".encode(), *b"q" * 140]
        assert index.matched_tokens("vllm-0", prompt_ids) == BLOCK_SIZE
        _completion(vllm.url, f"{tag} second " + "r" * 140, max_tokens=1)
        _completion(vllm.url, f"{tag} third " + "s" * 140, max_tokens=1)
        later = wait_for(lambda: [decode_frames(sub.recv_multipart())[1] for _ in range(2)] if sub.poll(5000) else None,
                         timeout=30, what="two more batches")
        assert index.apply("vllm-0", later[1]) is Applied.GAP  # later[0] "lost"
        assert index.matched_tokens("vllm-0", prompt_ids) == 0
        assert index.state("vllm-0") is SyncState.UNSYNCHRONISED and index.gaps("vllm-0") == 1
        assert index.resynchronise("vllm-0", _replay(vllm))
        assert index.state("vllm-0") is SyncState.SYNCHRONISED
        assert index.matched_tokens("vllm-0", prompt_ids) == BLOCK_SIZE
    finally:
        sub.close()


# ---- chats to token ids, as vLLM renders them -----------------------------------------------------
RENDER_CHATS = CHATS + [
    [{"role": "developer", "content": "rules"}, {"role": "user", "content": "go"}],
    [{"role": "user", "content": "call it"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}],
]


@pytest.mark.parametrize("messages", RENDER_CHATS)
def test_chat_token_ids_match_vllm_tokenize_and_transformers(vllm, vllm_fleet, backend_tokenizer, messages):
    from transformers import AutoTokenizer

    ours = backend_tokenizer.chat_token_ids(messages)
    theirs = post_json(vllm.url + "/tokenize", {"model": MODEL_NAME, "messages": messages})["tokens"]
    assert ours == theirs
    reference = AutoTokenizer.from_pretrained(vllm_fleet.checkpoint)
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if all(isinstance(m.get("content"), str) for m in messages) and not any(m["role"] == "developer" for m in messages):
        assert backend_tokenizer.render_chat(messages) == text
    assert backend_tokenizer.prompt_token_ids("abc") == reference("abc").input_ids == [256, 97, 98, 99]
