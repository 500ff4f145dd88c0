"""`prefixlb worker --simulate --sim-answers`: recorded answers over HTTP, seen through the openai client."""
from __future__ import annotations

import csv
import re

import openai
import pytest

from tests.integration.worker_client import call
from tests.support import free_port, processes, spawn
from worker.engine.tokenizer import ByteTokenizer
from worker.simulator.latency import LatencyModel
from worker.simulator.profiles import get_gpu, get_model

MODEL = "strong-m"
ROWS = [
    {"prompt": "Janet's ducks lay 16 eggs per day. How many are left after she eats 3?",
     "strong-m_response": "She has 16 - 3 = 13 eggs left.\n#### 13", "weak-m_response": "#### 12"},
    {"prompt": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
     "strong-m_response": "2 + 2 / 2 = 3 bolts — in total.", "weak-m_response": "#### 4"},
]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recorded")
    path = tmp / "answers.csv"
    # No correctness columns: the worker never needs (or sees) them.
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=["prompt", "weak-m_response", "strong-m_response"])
        writer.writeheader()
        writer.writerows(ROWS)
    port = free_port()
    args = ["worker", "--simulate", "--gpu", "H100-80G", "--sim-model", "llama-3-70b", "--time-scale", "1000",
            "--kv-blocks", "2048", "--sim-answers", str(path), "--sim-answers-model", MODEL,
            "--worker-id", "rec-a", "--port", str(port)]
    with processes() as procs:
        procs.append(spawn(args, tmp, "recorded-worker", port=port))
        yield procs[0].url


@pytest.fixture()
def client(worker):
    return openai.OpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0)


def test_a_chat_question_gets_the_recorded_answer_with_honest_token_counts(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ROWS[0]["prompt"]}])
    answer = ROWS[0]["strong-m_response"]
    assert reply.choices[0].message.content == answer
    assert reply.choices[0].finish_reason == "stop"
    rendered = ByteTokenizer().apply_chat_template([{"role": "user", "content": ROWS[0]["prompt"]}])
    assert reply.usage.prompt_tokens == 1 + len(rendered.encode())       # BOS + the rendered bytes
    assert reply.usage.completion_tokens == len(answer.encode()) + 1      # the answer's bytes + EOS


def test_a_completion_and_a_stream_replay_the_same_text(client):
    answer = ROWS[1]["strong-m_response"]  # non-ASCII: the byte tokens reassemble it
    completion = client.completions.create(model=MODEL, prompt=ROWS[1]["prompt"], max_tokens=500)
    assert completion.choices[0].text == answer
    stream = client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                            messages=[{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": ROWS[1]["prompt"]}])
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == len(answer.encode()) + 1


def test_logprobs_are_the_point_mass_of_a_deterministic_replay(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ROWS[0]["prompt"]}],
                                           logprobs=True, top_logprobs=2, max_tokens=6)
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == ROWS[0]["strong-m_response"][:6]
    assert [t.logprob for t in content] == [0.0] * 6
    assert all(t.top_logprobs[1].logprob == -9999.0 for t in content)


def test_a_prompt_without_a_recorded_answer_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert info.value.code == "prompt_not_recorded"
    # A judge's rubric quoting a recorded question is not that question.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=f"Rate: {ROWS[0]['prompt']} Answer: 13")


def test_the_answer_takes_the_latency_models_time(worker):
    model = LatencyModel(get_gpu("H100-80G"), get_model("llama-3-70b"))

    def modelled():
        text = call(worker + "/metrics").raw.decode()
        return float(re.search(r"^prefixlb_worker_sim_modelled_seconds_total (\S+)$", text, re.M).group(1))

    prompt = ROWS[0]["prompt"] + " "  # same question, a different prompt: nothing cached at the end
    before = modelled()
    body = call(worker + "/v1/completions", "POST", {"model": MODEL, "prompt": prompt, "max_tokens": 3}).json
    assert body["choices"][0]["text"] == ROWS[0]["strong-m_response"][:3]
    p = body["usage"]["prompt_tokens"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    expected = (model.prefill_time(p - cached, cached) + model.decode_step_time(1, p + 1)
                + model.decode_step_time(1, p + 2))
    assert modelled() - before == pytest.approx(expected, rel=1e-9)


def test_server_info_says_which_answers_it_replays(worker):
    info = call(worker + "/get_server_info").json
    assert info["recorded_answers"] == {"model": MODEL, "prompts": 2}
    assert [m["id"] for m in call(worker + "/v1/models").json["data"]] == [MODEL]
