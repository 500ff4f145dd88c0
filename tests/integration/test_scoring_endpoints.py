"""The HTTP verifier judge and the scoring client over real loopback HTTP: replies, deadlines,
bad statuses and malformed bodies, each turned into the judge's failure policy."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from router.virtual_models.judges.verdict import Candidate, JudgeUnavailable, decide
from router.virtual_models.judges.verifier import VerifierJudge
from router.virtual_models.scoring_http import ScoringEndpoint, ScoringError, ScoringTimeout
from tests.support import free_port


@contextlib.asynccontextmanager
async def serve(handler):
    """A verifier on 127.0.0.1 answering every POST with ``handler(request_json)``."""
    seen: list = []

    async def route(request):
        body = await request.json()
        seen.append(body)
        return await handler(body)

    app = web.Application()
    app.router.add_post("/verify", route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/verify", seen
    finally:
        await runner.cleanup()


def _reply(payload, status=200):
    async def handler(body):
        return web.json_response(payload, status=status)
    return handler


CAND = Candidate(prompt="How many eggs?", answer="#### 18", model="small",
                 request={"messages": [{"role": "user", "content": "How many eggs?"}]})


async def test_the_verifier_gets_prompt_and_response_and_its_accept_decides():
    async with serve(_reply({"accept": False, "score": 0.25})) as (url, seen):
        endpoint = ScoringEndpoint(url, timeout_s=2.0)
        verdict = await decide(VerifierJudge(endpoint), CAND)
        await endpoint.close()
    assert seen == [{"prompt": "How many eggs?", "response": "#### 18", "model": "small"}]
    assert (verdict.accept, verdict.score, verdict.reason, verdict.failed) == (False, 0.25, "rejected", False)


async def test_with_a_threshold_the_verifier_score_decides():
    async with serve(_reply({"accept": False, "score": 0.75})) as (url, seen):
        endpoint = ScoringEndpoint(url, timeout_s=2.0)
        judge = VerifierJudge(endpoint, threshold=0.5, include_messages=True)
        verdict = await decide(judge, CAND)
        await endpoint.close()
    assert (verdict.accept, verdict.score) == (True, 0.75)
    assert seen[0]["messages"] == [{"role": "user", "content": "How many eggs?"}]


@contextlib.asynccontextmanager
async def slow_verifier(timeout_s=0.2):
    """An endpoint to a verifier that answers only after the test is done with it."""
    release = asyncio.Event()

    async def slow(body):
        await release.wait()
        return web.json_response({"accept": True})

    async with serve(slow) as (url, _):
        endpoint = ScoringEndpoint(url, timeout_s=timeout_s)
        try:
            yield endpoint
        finally:
            release.set()
            await endpoint.close()


@pytest.mark.parametrize("policy, accept", [("accept", True), ("escalate", False)])
async def test_a_verifier_past_its_deadline_is_decided_by_the_timeout_policy(policy, accept):
    async with slow_verifier() as endpoint:
        verdict = await decide(VerifierJudge(endpoint, on_error=policy), CAND)
    assert (verdict.accept, verdict.failed, verdict.reason) == (accept, True, "timeout")
    assert verdict.latency_s >= 0.2


async def test_a_verifier_timeout_with_the_fail_policy_fails_the_request():
    async with slow_verifier() as endpoint:
        with pytest.raises(JudgeUnavailable, match="timeout"):
            await decide(VerifierJudge(endpoint, on_error="fail"), CAND)


@pytest.mark.parametrize("handler, reason", [
    (_reply({"accept": True}, status=500), "status"),
    (_reply({"accept": "yes"}), "invalid_reply"),
    (_reply(["accept"]), "invalid_reply"),
    (_reply({"accept": True, "score": "high"}), "invalid_reply"),
])
async def test_bad_verifier_replies_are_judge_failures(handler, reason):
    async with serve(handler) as (url, _):
        endpoint = ScoringEndpoint(url, timeout_s=2.0)
        verdict = await decide(VerifierJudge(endpoint), CAND)
        await endpoint.close()
    assert (verdict.failed, verdict.reason, verdict.accept) == (True, reason, False)


async def test_a_threshold_verifier_needs_a_score():
    async with serve(_reply({"accept": True})) as (url, _):
        endpoint = ScoringEndpoint(url, timeout_s=2.0)
        verdict = await decide(VerifierJudge(endpoint, threshold=0.5), CAND)
        await endpoint.close()
    assert (verdict.failed, verdict.reason) == (True, "invalid_reply")


async def test_an_oversized_or_non_json_reply_is_refused():
    async def huge(body):
        return web.Response(body=b"x" * 2048, content_type="application/json")

    async with serve(huge) as (url, _):
        endpoint = ScoringEndpoint(url, timeout_s=2.0, max_reply_bytes=1024)
        with pytest.raises(ScoringError, match="larger than 1024 bytes"):
            await endpoint.post({})
        endpoint.max_reply_bytes = 4096
        with pytest.raises(ScoringError, match="not JSON"):
            await endpoint.post({})
        await endpoint.close()


async def test_a_refused_connection_is_a_connect_error():
    endpoint = ScoringEndpoint(f"http://127.0.0.1:{free_port()}/verify", timeout_s=2.0)
    with pytest.raises(ScoringError) as info:
        await endpoint.post({"prompt": "x"})
    await endpoint.close()
    assert info.value.reason == "connect" and not isinstance(info.value, ScoringTimeout)
