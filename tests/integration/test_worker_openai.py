"""The official `openai` client against a live worker process running the real tiny engine."""
from __future__ import annotations

import http.client
import json
import re

import openai
import pytest

from tests.integration.worker_client import call
from tests.support import free_port, processes, spawn, wait_for

WORKER_ID = "tiny-openai"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    port = free_port()
    args = ["worker", "--model", "tiny", "--port", str(port), "--worker-id", WORKER_ID, "--kv-blocks", "512",
            "--threads", "1"]
    with processes() as procs:
        procs.append(spawn(args, tmp_path_factory.mktemp("tiny"), "tiny-worker", port=port, timeout=120))
        yield procs[0].url


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_with_usage_and_worker_identity(client):
    raw = client.completions.with_raw_response.create(model="tiny", prompt="Hello, world", max_tokens=8,
                                                       temperature=0)
    assert raw.headers["x-prefixlb-worker-id"] == WORKER_ID
    resp = raw.parse()
    assert resp.system_fingerprint == WORKER_ID
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens == 13  # BOS + 12 bytes
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Hi"}],
                                          max_tokens=6, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_gives_the_same_greedy_text_and_usage_at_the_end(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Count with me"}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_repeated_prefix_is_served_from_cache_with_identical_output(client):
    prompt = "The cache should remember this long shared prefix. " * 4  # 204 bytes: 205 tokens
    cold = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    warm = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == 192  # 12 full blocks of 16
    assert warm.choices[0].text == cold.choices[0].text


def test_completion_logprobs_have_openai_shape_and_greedy_picks_the_top_token(client):
    resp = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 2
        assert value == pytest.approx(max(top.values()))


def test_chat_logprobs_have_openai_shape(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert isinstance(entry.bytes, list)


def test_n_choices_use_consecutive_seeds_and_sum_their_usage(client):
    resp = client.completions.create(model="tiny", prompt="pick", max_tokens=6, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    singles = [client.completions.create(model="tiny", prompt="pick", max_tokens=6, temperature=1.0, seed=7 + i)
               for i in range(3)]
    by_index = {c.index: c.text for c in resp.choices}
    assert [by_index[i] for i in range(3)] == [s.choices[0].text for s in singles]
    assert resp.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_client_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-tiny", prompt="x")


def _metric(url: str, name: str) -> float:
    text = call(url + "/metrics").raw.decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(worker):
    host, port = worker.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "go on " * 20, "max_tokens": 3000,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    assert _metric(worker, "prefixlb_worker_kv_blocks_used") > 0
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_for(lambda: _metric(worker, "prefixlb_worker_kv_blocks_used") == 0
             and _metric(worker, "prefixlb_worker_requests_running") == 0, 20, what="blocks freed after disconnect")
