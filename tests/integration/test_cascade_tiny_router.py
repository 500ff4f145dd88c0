"""A logprob-judged (and an LLM-judged) cascade on the engine path: the real router in front of two real tiny-model
workers, the small and the large stage two ``tiny`` models drawn from different seeds
(``prefixlb model save tiny DIR --seed N``), asked with the openai client.

Greedy decoding on fixed weights is deterministic, so each prompt's judge score is a fixed
number: at a threshold of 0.25 (10th percentile of the small model's token probabilities)
"In the beginning" (score 0.3227) is kept and "The quick brown fox" (0.1684) escalates to the
large model, whose own answer then reaches the client. The margins (> 0.07) dwarf fp32 noise.
"""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from router.virtual_models.judges.logprob import LogprobJudge
from tests.integration.worker_client import call
from tests.support import ROOT, free_port, processes, spawn, wait_for

KEPT, ESCALATED = "In the beginning", "The quick brown fox"
SCORES = {KEPT: 0.3227, ESCALATED: 0.1684}
VIRTUAL = """virtual_models:
  smart:
    cascade:
      stages:
        - model: small
          judge: {kind: logprob, threshold: 0.25, quantile: 0.1}
        - model: large
  rated:
    cascade:
      stages:
        - model: small
          judge: {kind: llm, model: large, rubric: "Rate the answer.", threshold: 0.5, scale: 10, max_tokens: 4}
        - model: large
"""
PRICES = "models:\n  small: {input_per_mtok: 1, output_per_mtok: 2}\n  large: {input_per_mtok: 10, output_per_mtok: 20}\n"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny-cascade-router")
    for seed in (1, 2):
        subprocess.run([sys.executable, "-m", "prefixlb", "model", "save", "tiny", str(tmp / f"tiny-{seed}"),
                        "--seed", str(seed)], check=True, cwd=ROOT, capture_output=True, timeout=120)
    (tmp / "virtual.yaml").write_text(VIRTUAL)
    (tmp / "prices.yaml").write_text(PRICES)
    with processes() as procs:
        urls = []
        for name, seed in (("small", 1), ("large", 2)):
            port = free_port()
            procs.append(spawn(["worker", "--model", str(tmp / f"tiny-{seed}"), "--served-model-name", name,
                                "--port", str(port), "--kv-blocks", "256", "--threads", "1", "--worker-id", name],
                               tmp, name, port=port, timeout=120))
            urls.append(procs[-1].url)
        port = free_port()
        procs.append(spawn(["router", "--port", str(port), "--worker", urls[0], "--worker", urls[1],
                            "--virtual-models", str(tmp / "virtual.yaml"), "--price-book", str(tmp / "prices.yaml"),
                            "--admin-token", "t0ken"], tmp, "router", port=port))
        url = procs[-1].url
        wait_for(lambda: call(url + "/health").json["routable_workers"] == 2, what="2 routable workers")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        client.router_url = url
        yield client


def _direct(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, **kw)


def test_the_two_seeds_are_two_different_models(router):
    assert _direct(router, "small", KEPT).choices[0].text != _direct(router, "large", KEPT).choices[0].text


def test_a_confident_small_answer_is_kept_with_the_score_of_its_own_token_probabilities(router):
    own = _direct(router, "small", KEPT, logprobs=0).choices[0]
    result = _direct(router, "smart", KEPT)
    stage = result.usage.model_extra["prefixlb"]["stages"][0]
    assert (stage["model"], stage["outcome"]) == ("small", "accepted")
    assert stage["judge"]["score"] == pytest.approx(SCORES[KEPT], abs=1e-3)
    assert stage["judge"]["score"] == pytest.approx(LogprobJudge(0.25).score(own.logprobs.token_logprobs), abs=1e-4)
    assert result.choices[0].text == own.text
    assert result.choices[0].logprobs is None  # asked for the judge, not by the client


def test_an_unsure_small_answer_escalates_and_only_the_large_answer_streams(router):
    small = _direct(router, "small", ESCALATED).choices[0].text
    large = _direct(router, "large", ESCALATED).choices[0].text
    chunks = list(router.completions.create(model="smart", prompt=ESCALATED, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == large
    assert small not in "".join(c.model_dump_json() for c in chunks)
    ext = chunks[-1].usage.model_extra["prefixlb"]
    assert [(s["model"], s["outcome"]) for s in ext["stages"]] == [("small", "escalated"), ("large", "final")]
    assert ext["stages"][0]["judge"]["score"] == pytest.approx(SCORES[ESCALATED], abs=1e-3)
    assert ext["answered_by"] == "large"


def test_an_llm_judge_is_a_fleet_model_asked_through_the_router_and_its_cost_counts(router):
    # The tiny "large" model rates the small answer to this prompt 2 out of 10 (greedy, fixed
    # weights): below 0.5, so the cascade escalates to the large model.
    result = router.completions.create(model="rated", prompt=ESCALATED, max_tokens=8, temperature=0,
                                       extra_headers={"X-Session-Id": "rated"})
    ext = result.usage.model_extra["prefixlb"]
    judge = ext["stages"][0]["judge"]
    assert (judge["name"], judge["score"], judge["reason"]) == ("llm", 0.2, "below_threshold")
    assert ext["answered_by"] == "large" and judge["cost_usd"] > 0
    assert ext["cost_usd"] == pytest.approx(sum(s["cost_usd"] for s in ext["stages"]) + judge["cost_usd"], abs=1e-9)
    # The judge's call is one more answer of the large model, billed to the same tenant.
    usage = call(router.router_url + "/admin/usage", headers={"Authorization": "Bearer t0ken"}).json
    tenant = usage["tenants"]["session:rated"]
    assert {m: t["requests"] for m, t in tenant["models"].items()} == {"small": 1, "large": 2}
    assert tenant["total"]["cost_usd"] == pytest.approx(ext["cost_usd"], abs=1e-9)
