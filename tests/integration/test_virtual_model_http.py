"""Cascades and routes over real HTTP: two recorded-answer workers (weak, strong), a send that
posts to them, a classifier endpoint, and the accepted answer streamed to the openai client."""
from __future__ import annotations

import asyncio
import contextlib
import csv
import json

import aiohttp
import openai
import pytest
from aiohttp import web

from router.cost.price_book import HostedPrice, PriceBook
from router.virtual_models.answer import StageAnswer, StageError
from router.virtual_models.cascade import CascadeRunner
from router.virtual_models.classifier import RouteClassifier, resolve_route
from router.virtual_models.config import parse_virtual_models
from router.virtual_models.stream import sse_events
from tests.support import free_port, processes, spawn

QUESTIONS = ["Janet's ducks lay 16 eggs per day. How many are left after she eats 3?",
             "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?"]
WEAK = {QUESTIONS[0]: "16 - 3 = 13\n#### 13", QUESTIONS[1]: "WEAK-UNFORMATTED: I think it takes four bolts."}
STRONG = {QUESTIONS[0]: "She keeps 13.\n#### 13", QUESTIONS[1]: "2 + 1 = 3 bolts.\n#### 3"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    path = tmp / "answers.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["prompt", "weak_response", "strong_response"])
        writer.writerows([q, WEAK[q], STRONG[q]] for q in QUESTIONS)
    urls = {}
    with processes() as procs:
        for model, profile in (("weak", "llama-3-8b"), ("strong", "llama-3-70b")):
            port = free_port()
            procs.append(spawn(["worker", "--simulate", "--sim-model", profile, "--time-scale", "1000",
                                "--kv-blocks", "1024", "--sim-answers", str(path), "--sim-answers-model", model,
                                "--worker-id", f"{model}-1", "--port", str(port)], tmp, model, port=port))
            urls[model] = procs[-1].url
        yield urls


@contextlib.asynccontextmanager
async def sender(urls, chat=True):
    async with aiohttp.ClientSession() as session:
        async def send(model, body):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with session.post(urls[model] + path, json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise StageError(data["error"]["message"], resp.status, resp.status >= 500, data)
                return StageAnswer(model, data, resp.headers.get("x-prefixlb-worker-id"))
        yield send


FORMAT = {"kind": "regex", "pattern": r"^#### -?[0-9][0-9,]*$"}
BOOK = PriceBook({"weak": HostedPrice(0.6, 0.6), "strong": HostedPrice(10.0, 30.0)})


def _cascade(judge):
    return parse_virtual_models({"smart": {"cascade": {"stages": [{"model": "weak", "judge": judge},
                                                                  {"model": "strong"}]}}})["smart"]


def _chat(question):
    return {"model": "smart", "messages": [{"role": "user", "content": question}]}


async def test_a_formatted_weak_answer_is_kept_and_an_unformatted_one_escalates(fleet):
    async with sender(fleet) as send:
        runner = CascadeRunner.build(_cascade(FORMAT), send, price_book=BOOK)
        kept = await runner.run(_chat(QUESTIONS[0]), chat=True)
        escalated = await runner.run(_chat(QUESTIONS[1]), chat=True)
    assert (kept.answered_by, kept.body["choices"][0]["message"]["content"]) == ("weak", WEAK[QUESTIONS[0]])
    assert (escalated.answered_by, escalated.body["choices"][0]["message"]["content"]) == ("strong", STRONG[QUESTIONS[1]])
    assert [s.worker_id for s in escalated.stages] == ["weak-1", "strong-1"]
    assert "WEAK-UNFORMATTED" not in json.dumps([escalated.body, escalated.extension(), escalated.headers()])
    # Priced from the workers' own usage: the weak call, then the strong one.
    weak, strong = escalated.stages
    expected = (weak.usage.prompt_tokens * 0.6 + weak.usage.completion_tokens * 0.6
                + strong.usage.prompt_tokens * 10.0 + strong.usage.completion_tokens * 30.0) / 1e6
    assert escalated.cost_usd == pytest.approx(expected)


async def test_a_logprob_judge_gets_the_replays_point_mass_and_the_client_gets_no_logprobs(fleet):
    # The replay's own distribution puts all mass on the recorded token (p = 1): the judge
    # accepts every weak answer. Honest, and uninformative: see the docs on the replay.
    async with sender(fleet) as send:
        runner = CascadeRunner.build(_cascade({"kind": "logprob", "threshold": 0.9}), send)
        result = await runner.run(_chat(QUESTIONS[1]), chat=True)
    assert result.answered_by == "weak" and result.stages[0].verdict.score == 1.0
    assert result.body["choices"][0]["logprobs"] is None


async def test_a_stage_refusing_the_prompt_as_a_client_error_ends_the_cascade(fleet):
    from router.virtual_models.cascade import CascadeFailed

    async with sender(fleet) as send:
        runner = CascadeRunner.build(_cascade(FORMAT), send)
        with pytest.raises(CascadeFailed) as info:
            await runner.run(_chat("What is 2 + 2?"), chat=True)
    assert (info.value.status, info.value.body["error"]["code"]) == (400, "prompt_not_recorded")
    assert [s.model for s in info.value.stages] == ["weak"]


@contextlib.asynccontextmanager
async def serve(handler, path):
    app = web.Application()
    app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_the_accepted_answer_streams_to_the_openai_client(fleet):
    async with sender(fleet) as send:
        result = await CascadeRunner.build(_cascade(FORMAT), send).run(
            {**_chat(QUESTIONS[1]), "stream": True, "stream_options": {"include_usage": True}}, chat=True)

    async def stream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **result.headers()})
        await resp.prepare(request)
        for event in sse_events(result.body, chat=True, include_usage=True):
            await resp.write(event)
        return resp

    async with serve(stream, "/v1/chat/completions") as base:
        def consume():
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            return list(client.chat.completions.create(model="smart", messages=_chat(QUESTIONS[1])["messages"],
                                                       stream=True, stream_options={"include_usage": True}))
        chunks = await asyncio.to_thread(consume)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == STRONG[QUESTIONS[1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == result.stages[-1].usage.completion_tokens


async def test_completions_stream_as_one_text_chunk():
    body = {"id": "c1", "object": "text_completion", "created": 5, "model": "strong",
            "choices": [{"index": 0, "text": "#### 3", "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}
    events = sse_events(body, chat=False, include_usage=False)
    assert [json.loads(e[6:]) if e != b"data: [DONE]\n\n" else "[DONE]" for e in events] == [
        {"id": "c1", "created": 5, "model": "strong", "object": "text_completion",
         "choices": [{"index": 0, "text": "#### 3", "logprobs": None, "finish_reason": "stop"}]}, "[DONE]"]


async def test_a_route_asks_its_classifier_only_when_no_rule_decides():
    asked = []
    release = asyncio.Event()

    async def score(request):
        body = await request.json()
        asked.append(body)
        if "slow" in body["prompt"]:
            await release.wait()
        return web.json_response({"score": 0.8 if "hard" in body["prompt"] else 0.1})

    async with serve(score, "/score") as base:
        route = parse_virtual_models({"auto": {"route": {
            "default": "weak", "rules": [{"model": "strong", "when": {"keywords": ["prove"]}}],
            "classifier": {"url": base + "/score", "threshold": 0.5, "above": "strong", "timeout_s": 0.3}}}})["auto"]
        classifier = RouteClassifier(route.classifier)
        by_rule = await resolve_route(route, _chat("prove it"), True, classifier=classifier)
        hard = await resolve_route(route, _chat("a hard one"), True, classifier=classifier)
        easy = await resolve_route(route, _chat("easy"), True, classifier=classifier)
        slow = await resolve_route(route, _chat("slow hard"), True, classifier=classifier)
        release.set()
        await classifier.close()
    assert (by_rule.model, by_rule.reason) == ("strong", "rule:0")
    assert (hard.model, hard.reason, hard.score) == ("strong", "classifier:above", 0.8)
    assert (easy.model, easy.reason) == ("weak", "classifier:below")
    assert (slow.model, slow.reason) == ("weak", "classifier_error:timeout")
    assert [a["prompt"] for a in asked] == ["a hard one", "easy", "slow hard"]
    assert asked[0]["model"] == "auto"
