"""The logprob judge on real logprobs: a cascade over two live tiny-model workers decides on the
engine's own token probabilities, asked for by the cascade and stripped before the client."""
from __future__ import annotations

import aiohttp
import pytest

from router.virtual_models.answer import StageAnswer, StageError
from router.virtual_models.cascade import CascadeRunner
from router.virtual_models.config import parse_virtual_models
from router.virtual_models.judges.logprob import LogprobJudge
from tests.support import free_port, processes, spawn


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny-cascade")
    urls = {}
    with processes() as procs:
        for name in ("tiny", "tiny-large"):
            port = free_port()
            procs.append(spawn(["worker", "--model", "tiny", "--served-model-name", name, "--port", str(port),
                                "--kv-blocks", "256", "--threads", "1", "--worker-id", name], tmp, name,
                               port=port, timeout=120))
            urls[name] = procs[-1].url
        yield urls


def _cascade(threshold):
    return parse_virtual_models({"smart": {"cascade": {"stages": [
        {"model": "tiny", "judge": {"kind": "logprob", "threshold": threshold, "quantile": 0.1}},
        {"model": "tiny-large"}]}}})["smart"]


BODY = {"model": "smart", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


async def _run(fleet, threshold):
    async with aiohttp.ClientSession() as session:
        async def send(model, body):
            async with session.post(fleet[model] + "/v1/completions", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise StageError(str(data), resp.status, resp.status >= 500, data)
                return StageAnswer(model, data, resp.headers.get("x-prefixlb-worker-id"))

        direct = await send("tiny", {**BODY, "model": "tiny", "logprobs": 0})
        result = await CascadeRunner.build(_cascade(threshold), send).run(BODY, chat=False)
    return direct, result


async def test_the_judge_scores_the_engines_own_token_probabilities(fleet):
    direct, _ = await _run(fleet, 0.0)
    logprobs = direct.body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) >= 1 and all(lp <= 0 for lp in logprobs) and any(lp < 0 for lp in logprobs)
    score = LogprobJudge(0.5).score(logprobs)
    # Below the score the small model's answer stands; above it, the large one answers. (A
    # prompt served from the prefix cache computes in another order: fp32 differs by ~1e-6.)
    _, kept = await _run(fleet, max(0.0, score - 0.01))
    _, escalated = await _run(fleet, min(1.0, score + 0.01))
    assert kept.answered_by == "tiny" and kept.stages[0].verdict.score == pytest.approx(score, abs=1e-4)
    assert kept.body["choices"][0]["text"] == direct.body["choices"][0]["text"]
    assert kept.body["choices"][0]["logprobs"] is None  # asked for the judge, not by the client
    assert escalated.answered_by == "tiny-large"
    assert [s.outcome for s in escalated.stages] == ["escalated", "final"]
