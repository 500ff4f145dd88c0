"""Virtual models served by the real router process, in front of two recorded-answer simulated
workers (weak, strong), asked with the official openai client over loopback HTTP.

A cascade's stages go through the router's cache-aware proxy (each stage's request is the
client's original one, routed in its model's pool), the accepted answer reaches the client
whole or as a stream, a rejected answer never does, and every answer is priced: response
headers, the usage extension, ``GET /admin/usage`` and ``/metrics`` agree.
"""
from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import subprocess
import sys
import threading

import openai
import pytest
from aiohttp import web

from tests.integration.worker_client import call, is_openai_error
from tests.support import ROOT, free_port, processes, spawn, wait_for

QUESTIONS = ["Janet's ducks lay 16 eggs per day. How many are left after she eats 3?",
             "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
             "Tom has 5 apples and buys 7 more. How many apples does he have now?"]
WEAK = {QUESTIONS[0]: "16 - 3 = 13\n#### 13", QUESTIONS[1]: "WEAK-UNFORMATTED: I think it takes four bolts.",
        QUESTIONS[2]: "WEAK-UNFORMATTED: twelve, I believe."}
STRONG = {QUESTIONS[0]: "She keeps 13.\n#### 13", QUESTIONS[1]: "2 + 1 = 3 bolts.\n#### 3",
          QUESTIONS[2]: "5 + 7 = 12\n#### 12"}
ADMIN = {"Authorization": "Bearer admin-s3cret"}
PRICES = {"weak": (0.6, 0.6), "strong": (10.0, 30.0)}


@contextlib.contextmanager
def classifier_service():
    """A route classifier on loopback, served from a thread: ``{"prompt"} -> {"score"}``, high for
    questions about bolts."""
    async def score(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"score": 0.9 if "bolts" in body["prompt"] else 0.1})

    port, started, loop = free_port(), threading.Event(), asyncio.new_event_loop()

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/score", score)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = loop.run_until_complete(serve())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _virtual_models(dead_url: str, classifier_url: str) -> str:
    fmt = '{kind: regex, pattern: "^#### -?[0-9][0-9,]*$"}'
    return f"""
virtual_models:
  smart:
    cascade:
      stages:
        - model: weak
          judge: {fmt}
        - model: strong
  smart-lp:
    cascade:
      stages:
        - model: weak
          judge: {{kind: logprob, threshold: 0.9}}
        - model: strong
  strict:
    cascade:
      stages:
        - model: weak
          judge: {{kind: verifier, url: "{dead_url}", timeout_s: 0.5, on_error: fail}}
        - model: strong
  lenient:
    cascade:
      stages:
        - model: weak
          judge: {{kind: verifier, url: "{dead_url}", timeout_s: 0.5, on_error: escalate}}
        - model: strong
  tiered:
    route:
      default: weak
      rules:
        - model: strong
          when: {{header: {{name: x-tier, equals: premium}}}}
  auto:
    route:
      default: weak
      classifier: {{url: "{classifier_url}", threshold: 0.5, above: strong, timeout_s: 2}}
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    with classifier_service() as classifier:
        yield from _router(tmp_path_factory.mktemp("virtual-router"), classifier)


def _router(tmp, classifier):
    answers = tmp / "answers.csv"
    with open(answers, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["prompt", "weak_response", "strong_response"])
        writer.writerows([q, WEAK[q], STRONG[q]] for q in QUESTIONS)
    (tmp / "virtual.yaml").write_text(_virtual_models(f"http://127.0.0.1:{free_port()}/verify", classifier))
    (tmp / "prices.yaml").write_text("models:\n" + "".join(
        f"  {m}: {{input_per_mtok: {i}, output_per_mtok: {o}}}\n" for m, (i, o) in PRICES.items()))
    with processes() as procs:
        urls = []
        for model, profile in (("weak", "llama-3-8b"), ("strong", "llama-3-70b")):
            port = free_port()
            procs.append(spawn(["worker", "--simulate", "--sim-model", profile, "--time-scale", "1000",
                                "--kv-blocks", "1024", "--sim-answers", str(answers), "--sim-answers-model", model,
                                "--worker-id", f"{model}-1", "--port", str(port)], tmp, model, port=port))
            urls.append(procs[-1].url)
        port = free_port()
        procs.append(spawn(["router", "--port", str(port), *(a for u in urls for a in ("--worker", u)),
                            "--virtual-models", str(tmp / "virtual.yaml"), "--price-book", str(tmp / "prices.yaml"),
                            "--admin-token", "admin-s3cret"], tmp, "router", port=port))
        url = procs[-1].url
        wait_for(lambda: call(url + "/health").json["routable_workers"] == 2, what="2 routable workers")
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _ask(url: str, model: str, question: str, **kw):
    raw = _client(url).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": question}], **kw)
    return raw.headers, raw.parse()


def _cost(stage: dict) -> float:
    inp, out = PRICES[stage["model"]]
    plain = stage["prompt_tokens"] - stage["cached_tokens"]
    return (plain * inp + stage["cached_tokens"] * inp * 0.1 + stage["completion_tokens"] * out) / 1e6


def _metric(url: str, line_start: str) -> float:
    text = call(url + "/metrics").raw.decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


def test_models_lists_the_virtual_models_beside_the_real_ones(router):
    models = {m.id: m for m in _client(router).models.list().data}
    assert set(models) == {"weak", "strong", "smart", "smart-lp", "strict", "lenient", "tiered", "auto"}
    assert models["smart"].model_extra["prefixlb"] == {"kind": "cascade", "stages": ["weak", "strong"],
                                                       "max_escalations": 1}
    assert models["tiered"].model_extra["prefixlb"] == {"kind": "route", "models": ["strong", "weak"]}


def test_an_accepted_weak_answer_is_returned_with_its_stages_and_cost(router):
    headers, completion = _ask(router, "smart", QUESTIONS[0])
    assert completion.choices[0].message.content == WEAK[QUESTIONS[0]]
    ext = completion.usage.model_extra["prefixlb"]
    assert [(s["model"], s["outcome"]) for s in ext["stages"]] == [("weak", "accepted")]
    assert ext["stages"][0]["worker"] == "weak-1" and ext["stages"][0]["judge"]["accept"] is True
    assert headers["x-prefixlb-cascade"] == "weak:accepted"
    assert headers["x-prefixlb-answered-by"] == "weak" and headers["x-prefixlb-virtual-model"] == "smart"
    assert float(headers["x-prefixlb-cost-usd"]) == pytest.approx(_cost(ext["stages"][0]), abs=1e-9)
    assert ext["cost_usd"] == pytest.approx(_cost(ext["stages"][0]), abs=1e-9)


def test_an_escalation_streams_only_the_strong_answer_and_its_cold_then_warm_prefill_is_priced(router):
    before = call(router + "/admin/usage", headers=ADMIN).json
    client = _client(router)
    raw = client.chat.completions.with_raw_response.create(
        model="smart", messages=[{"role": "user", "content": QUESTIONS[1]}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == STRONG[QUESTIONS[1]]
    assert "WEAK-UNFORMATTED" not in json.dumps([c.model_dump() for c in chunks])
    assert raw.headers["x-prefixlb-cascade"] == "weak:escalated,strong:final"
    assert raw.headers["x-prefixlb-answered-by"] == "strong"
    ext = chunks[-1].usage.model_extra["prefixlb"]
    assert [(s["model"], s["outcome"]) for s in ext["stages"]] == [("weak", "escalated"), ("strong", "final")]
    assert ext["stages"][0]["judge"]["reason"] == "no_match"
    assert float(raw.headers["x-prefixlb-cost-usd"]) == pytest.approx(sum(_cost(s) for s in ext["stages"]), abs=1e-9)
    # The same question again: the escalation's original request is routed to the strong pool
    # like any request, so its prompt is now warm there and its cached tokens are billed at 0.1x.
    _, again = _ask(router, "smart", QUESTIONS[1])
    warm = again.usage.model_extra["prefixlb"]["stages"][1]
    assert warm["cached_tokens"] > 0 and warm["cached_tokens"] == again.usage.prompt_tokens_details.cached_tokens
    assert warm["cost_usd"] < ext["stages"][1]["cost_usd"]
    after = call(router + "/admin/usage", headers=ADMIN).json
    for model, stage in (("weak", ext["stages"][0]), ("strong", ext["stages"][1])):
        gained = after["models"][model]["requests"] - before["models"].get(model, {}).get("requests", 0)
        assert gained == 2, model
    spent = after["total"]["cost_usd"] - before["total"]["cost_usd"]
    assert spent == pytest.approx(ext["cost_usd"] + again.usage.model_extra["prefixlb"]["cost_usd"], abs=1e-8)
    assert after["models"]["strong"]["no_cache_cost_usd"] > after["models"]["strong"]["cost_usd"]
    assert after["price_book"] == "prices"
    assert _metric(router, 'prefixlb_router_cascade_stage_outcomes_total{model="weak",outcome="escalated",'
                           'virtual_model="smart"}') >= 2
    assert _metric(router, 'prefixlb_router_cost_usd_total{kind="actual",model="strong"}') == pytest.approx(
        after["models"]["strong"]["cost_usd"], rel=1e-6)
    assert _metric(router, 'prefixlb_router_cascade_judge_seconds_count{judge="regex",virtual_model="smart"}') >= 2


def test_the_ledger_bills_each_stage_to_the_requests_tenant(router):
    headers, completion = _ask(router, "smart", QUESTIONS[2], extra_headers={"X-Session-Id": "alice"})
    ext = completion.usage.model_extra["prefixlb"]
    tenant = call(router + "/admin/usage", headers=ADMIN).json["tenants"]["session:alice"]
    assert {m: t["requests"] for m, t in tenant["models"].items()} == {"weak": 1, "strong": 1}
    assert tenant["total"]["cost_usd"] == pytest.approx(ext["cost_usd"], abs=1e-9)
    assert tenant["models"]["strong"]["completion_tokens"] == ext["stages"][1]["completion_tokens"]


def test_the_router_asks_for_logprobs_for_its_judge_and_strips_them(router):
    _, completion = _ask(router, "smart-lp", QUESTIONS[1])
    # The replay's distribution is a point mass (p = 1 per token): the judge accepts.
    stage = completion.usage.model_extra["prefixlb"]["stages"][0]
    assert (stage["outcome"], stage["judge"]["score"]) == ("accepted", 1.0)
    assert completion.choices[0].logprobs is None
    _, asked = _ask(router, "smart-lp", QUESTIONS[1], logprobs=True)
    assert len(asked.choices[0].logprobs.content) == asked.usage.completion_tokens  # one per token, EOS too


def test_a_failing_judge_follows_its_policy(router):
    with pytest.raises(openai.APIStatusError) as info:
        _ask(router, "strict", QUESTIONS[0])
    assert info.value.status_code == 503 and info.value.body["code"] == "judge_unavailable"
    headers, completion = _ask(router, "lenient", QUESTIONS[0])
    stage = completion.usage.model_extra["prefixlb"]["stages"][0]
    assert (stage["outcome"], stage["judge"]["failed"], stage["judge"]["reason"]) == ("escalated", True, "connect")
    assert completion.choices[0].message.content == STRONG[QUESTIONS[0]]
    assert _metric(router, 'prefixlb_router_cascade_judge_errors_total{judge="verifier",reason="connect",'
                           'virtual_model="lenient"}') >= 1
    assert _metric(router, 'prefixlb_router_virtual_model_failures_total{code="judge_unavailable",'
                           'virtual_model="strict"}') >= 1


def test_a_request_can_lower_the_escalations_and_cannot_ask_for_several_choices(router):
    headers, completion = _ask(router, "smart", QUESTIONS[2], extra_headers={"X-Prefixlb-Max-Escalations": "0"})
    assert completion.choices[0].message.content == WEAK[QUESTIONS[2]]
    assert headers["x-prefixlb-cascade"] == "weak:final"
    with pytest.raises(openai.BadRequestError) as info:
        _ask(router, "smart", QUESTIONS[2], n=2)
    assert info.value.body["param"] == "n"
    bad = call(router + "/v1/chat/completions", "POST", {"model": "smart", "messages": [
        {"role": "user", "content": QUESTIONS[2]}]}, headers={"X-Prefixlb-Max-Escalations": "-1"})
    assert bad.status == 400 and is_openai_error(bad)


def test_a_stage_refusing_the_prompt_ends_the_cascade_with_its_client_error(router):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(router, "smart", "What is 2 + 2?")
    assert info.value.body["code"] == "prompt_not_recorded"


def test_a_route_sends_the_whole_request_to_the_model_its_rules_choose(router):
    headers, premium = _ask(router, "tiered", QUESTIONS[1], extra_headers={"X-Tier": "premium"})
    assert premium.choices[0].message.content == STRONG[QUESTIONS[1]] and premium.model == "strong"
    assert (headers["x-prefixlb-answered-by"], headers["x-prefixlb-route-decision"]) == ("strong", "rule:0")
    usage = premium.usage
    assert float(headers["x-prefixlb-cost-usd"]) == pytest.approx(_cost(
        {"model": "strong", "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
         "cached_tokens": usage.prompt_tokens_details.cached_tokens}), abs=1e-9)
    stream = _client(router).chat.completions.create(
        model="tiered", messages=[{"role": "user", "content": QUESTIONS[1]}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == WEAK[QUESTIONS[1]]
    assert _metric(router, 'prefixlb_router_route_decisions_total{model="weak",reason="default",'
                           'virtual_model="tiered"}') == 1


def test_a_route_asks_its_classifier_when_no_rule_decides(router):
    headers, hard = _ask(router, "auto", QUESTIONS[1])
    assert hard.choices[0].message.content == STRONG[QUESTIONS[1]]
    assert (headers["x-prefixlb-route-decision"], headers["x-prefixlb-route-score"]) == ("classifier:above", "0.9")
    headers, easy = _ask(router, "auto", QUESTIONS[0])
    assert easy.choices[0].message.content == WEAK[QUESTIONS[0]]
    assert headers["x-prefixlb-route-decision"] == "classifier:below"


def test_the_admin_api_replaces_virtual_models_and_refuses_a_bad_set(router):
    bad = call(router + "/admin/virtual-models", "PUT", {"x": {"cascade": {"stages": [
        {"model": "weak", "judge": {"kind": "logprob", "threshold": 2}}, {"model": "strong"}]}}}, headers=ADMIN)
    assert bad.status == 400 and is_openai_error(bad) and bad.json["error"]["code"] == "invalid_virtual_models"
    assert "virtual_models.x.cascade.stages[0].judge.threshold" in bad.json["error"]["message"]
    assert "x" not in {m.id for m in _client(router).models.list().data}
    ok = call(router + "/admin/virtual-models", "PUT", {"fast": {"route": {"default": "weak", "rules": [
        {"model": "strong", "when": {"keywords": ["bolts"]}}]}}}, headers=ADMIN)
    assert ok.status == 200 and ok.json["virtual_models"] == {"fast": {"kind": "route", "models": ["strong", "weak"]}}
    _, answer = _ask(router, "fast", QUESTIONS[1])
    assert answer.choices[0].message.content == STRONG[QUESTIONS[1]]
    with pytest.raises(openai.NotFoundError):
        _ask(router, "smart", QUESTIONS[0])


def test_a_bad_virtual_model_file_stops_the_router_at_startup(tmp_path):
    path = tmp_path / "virtual.yaml"
    path.write_text("virtual_models:\n  smart:\n    cascade:\n      stages:\n        - model: weak\n"
                    "        - model: strong\n")
    done = subprocess.run([sys.executable, "-m", "prefixlb", "router", "--port", str(free_port()),
                           "--virtual-models", str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert "virtual_models.smart.cascade.stages[0]: every stage but the last needs a 'judge'" in done.stderr
