"""`--tool-call-parser hermes`: a model's <tool_call> blocks come back as OpenAI ``tool_calls``,
whole and streamed, as the official ``openai`` client reads them.

The simulated worker replays recorded answers (``--sim-answers``), so the "model" answers with
exactly the tool-call text a Hermes / Qwen 2.5 model writes, one byte token at a time.
"""
from __future__ import annotations

import csv
import json

import openai
import pytest

from tests.support import free_port, processes, spawn

MODEL = "m"
WEATHER_Q = "What is the weather in Zürich and the time?"
CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Zurich"}}\n</tool_call>')
PLAIN_Q = "Say hello."
PLAIN = "Hello <tool friend>!"  # a "<tool" that is not a call: held back, then sent as content
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
EXPECTED = [("get_weather", {"city": "Zürich"}), ("get_time", {"tz": "Europe/Zurich"})]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    with open(tmp / "answers.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=["prompt", f"{MODEL}_response"])
        writer.writeheader()
        writer.writerows([{"prompt": WEATHER_Q, f"{MODEL}_response": CALLS},
                          {"prompt": PLAIN_Q, f"{MODEL}_response": PLAIN}])
    port = free_port()
    args = ["worker", "--simulate", "--time-scale", "1000", "--kv-blocks", "2048", "--sim-answers",
            str(tmp / "answers.csv"), "--sim-answers-model", MODEL, "--tool-call-parser", "hermes",
            "--port", str(port)]
    with processes() as procs:
        procs.append(spawn(args, tmp, "tool-worker", port=port))
        yield openai.OpenAI(base_url=procs[0].url + "/v1", api_key="unused", max_retries=0)


def _ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_tool_calls_come_back_parsed_with_finish_reason_tool_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=_ask(WEATHER_Q), tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)


def test_streamed_tool_calls_accumulate_in_the_openai_clients_stream_helper(client):
    with client.chat.completions.stream(model=MODEL, messages=_ask(WEATHER_Q), tools=TOOLS) as stream:
        content = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert content == choice.message.content == "Let me check.\n"
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == EXPECTED


def test_an_answer_without_calls_is_content_streamed_or_not(client):
    reply = client.chat.completions.create(model=MODEL, messages=_ask(PLAIN_Q), tools=TOOLS)
    assert (reply.choices[0].message.content, reply.choices[0].message.tool_calls) == (PLAIN, None)
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=_ask(PLAIN_Q), tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == PLAIN
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice_none_leaves_the_text_unparsed(client):
    reply = client.chat.completions.create(model=MODEL, messages=_ask(WEATHER_Q), tools=TOOLS, tool_choice="none")
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (CALLS, "stop")
    assert reply.choices[0].message.tool_calls is None
