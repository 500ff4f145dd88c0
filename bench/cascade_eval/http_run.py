"""The evaluation over HTTP: the real router, its cascades, two recorded-answer workers.

Every number here is measured as a client sees it. The router (``prefixlb router
--virtual-models --price-book``) serves one cascade virtual model per judge (weak stage judged,
strong stage final) in front of the two recorded-answer workers; the arithmetic judge is an
HTTP verifier this process serves (:func:`bench.cascade_eval.arithmetic.verifier_app`).

1. **Tuning half**: every question through every judge's cascade; the judge's score of the weak
   answer comes back in ``usage.prefixlb``; the threshold is chosen on those scores exactly as
   offline (the most gain over random routing).
2. The chosen thresholds are put in force with ``PUT /admin/virtual-models``.
3. **Held-out half**: ``always_weak`` and ``always_strong`` (the real models directly), ``random``
   (a seeded random subset of the first judge's measured share sent to the strong model), and
   each judge's cascade. Accuracy: the correctness label of the model that answered (the
   ``X-Prefixlb-Answered-By`` header); strong share: the escalated share; cost: the router's own
   ledger (``GET /admin/usage`` before and after, divided by the questions), cross-checked with
   the sum of the ``X-Prefixlb-Cost-USD`` headers; ``E[cost] = c_s + (1 − p)·c_l`` with ``c_s``,
   ``c_l`` and ``p`` read from the stages the router reports.

Each policy's requests carry their own ``cache_salt``: every policy meets a cold fleet, as the
offline replay assumes (only the chat template's first bytes, shared between questions that
begin alike, can be cached within a policy).
"""
from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import yaml
from aiohttp import web

from bench.cascade_eval.arithmetic import verifier_app
from bench.cascade_eval.dataset import Question, RoutingDataset, load_dataset, split_halves
from bench.cascade_eval.fleet import Fleet, recorded_fleet
from bench.cascade_eval.metrics import apgr, best_gain_over_random, cascade_curve, cpt, pgr, random_accuracy
from bench.cascade_eval.offline import EXCLUDED_JUDGES, FINAL_ANSWER, evaluate, question_costs
from protocol.loopback import free_port
from router.cost.price_book import HostedPrice, PriceBook, SelfHostedPrice

JUDGES = ("format", "arithmetic", "format+arithmetic")
CONCURRENCY = 16
MAX_TOKENS = 4096


def judge_config(name: str, threshold: float | None, verifier_url: str) -> dict[str, Any]:
    """The judge ``name`` as router configuration; ``threshold``: escalate scores below it
    (None: the judge's own accept; only thresholds in (0, 1] are expressible)."""
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"judge {name}: threshold {threshold} (never or always escalate) is not a judge setting")
    fmt = {"kind": "regex", "pattern": FINAL_ANSWER, "name": "format"}
    arithmetic: dict[str, Any] = {"kind": "verifier", "url": verifier_url, "timeout_s": 30.0, "name": "arithmetic"}
    if threshold is not None:
        arithmetic["threshold"] = threshold
    # The format check's score is 0 or 1, so any threshold in (0, 1] is its own accept.
    return {"format": fmt, "arithmetic": arithmetic,
            "format+arithmetic": {"kind": "all_of", "name": "format+arithmetic", "judges": [fmt, arithmetic]}}[name]


def cascade_models(dataset: RoutingDataset, thresholds: dict[str, float | None], verifier_url: str) -> dict:
    """One cascade virtual model per judge: ``cascade-<judge>``."""
    return {f"cascade-{name}": {"cascade": {"stages": [
        {"model": dataset.weak_model, "judge": judge_config(name, t, verifier_url)},
        {"model": dataset.strong_model}]}} for name, t in thresholds.items()}


def price_book_yaml(book: PriceBook) -> dict:
    """``book`` as the YAML the router reads (hosted prices only)."""
    models = {}
    for model, p in book.models.items():
        if isinstance(p, SelfHostedPrice):
            raise ValueError(f"{model}: the HTTP evaluation prices hosted models only")
        assert isinstance(p, HostedPrice)
        models[model] = {"input_per_mtok": p.input_per_mtok, "output_per_mtok": p.output_per_mtok,
                         "cache_read_multiplier": p.cache_read_multiplier,
                         "cache_write_5m_multiplier": p.cache_write_5m_multiplier,
                         "cache_write_1h_multiplier": p.cache_write_1h_multiplier,
                         "min_cacheable_tokens": p.min_cacheable_tokens}
    return {"name": book.name, "models": models}


class Client:
    """Requests to the router: chat completions of one question, admin calls."""

    def __init__(self, session: aiohttp.ClientSession, fleet: Fleet) -> None:
        self.session = session
        self.url = fleet.router_url
        self.admin = {"Authorization": f"Bearer {fleet.admin_token}"}
        self.gate = asyncio.Semaphore(CONCURRENCY)

    async def ask(self, model: str, question: Question, salt: str) -> tuple[dict, dict]:
        body = {"model": model, "messages": [{"role": "user", "content": question.prompt}], "temperature": 0,
                "max_tokens": MAX_TOKENS, "cache_salt": salt}
        async with self.gate:
            async with self.session.post(self.url + "/v1/chat/completions", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{model} on question {question.index}: HTTP {resp.status} {data}")
                return dict(resp.headers), data

    async def ask_all(self, model: str, questions: Sequence[Question], salt: str) -> list[tuple[dict, dict]]:
        return await asyncio.gather(*(self.ask(model, q, salt) for q in questions))

    async def admin_call(self, method: str, path: str, body: Any = None) -> dict:
        async with self.session.request(method, self.url + "/admin" + path, json=body, headers=self.admin) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{method} /admin{path}: HTTP {resp.status} {data}")
            return data

    async def wait_routable(self, n: int, timeout: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            async with self.session.get(self.url + "/health") as resp:
                if (await resp.json()).get("routable_workers") == n:
                    return
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the router did not see {n} routable workers in {timeout:g} s")
            await asyncio.sleep(0.1)

    async def measured(self, model: str, questions: Sequence[Question], salt: str) -> tuple[list[tuple[dict, dict]], float]:
        """The answers and the mean cost per question by the router's ledger."""
        before = (await self.admin_call("GET", "/usage"))["total"]["cost_usd"]
        answers = await self.ask_all(model, questions, salt)
        after = (await self.admin_call("GET", "/usage"))["total"]["cost_usd"]
        return answers, (after - before) / len(questions)


def _stages(answer: tuple[dict, dict]) -> list[dict]:
    return answer[1]["usage"]["prefixlb"]["stages"]


def _score(answer: tuple[dict, dict]) -> float:
    judge = _stages(answer)[0]["judge"]
    return judge["score"] if judge["score"] is not None else float(judge["accept"])


def _direct_entry(questions: Sequence[Question], strong: Sequence[bool], cost: float, weak: float,
                  strong_acc: float) -> dict:
    accuracy = sum(q.strong_correct if s else q.weak_correct for q, s in zip(questions, strong)) / len(questions)
    return {"accuracy": accuracy, "strong_share": sum(strong) / len(questions), "cost": cost,
            "pgr": pgr(accuracy, weak, strong_acc)}


def _judge_entry(answers: list[tuple[dict, dict]], cost: float, test: Sequence[Question], dataset: RoutingDataset,
                 weak: float, strong: float, threshold: float, tune_point: dict, c_l_mean: float) -> dict:
    answered_strong = [a[0]["X-Prefixlb-Answered-By"] == dataset.strong_model for a in answers]
    entry = _direct_entry(test, answered_strong, cost, weak, strong)
    scores = [_score(a) for a in answers]
    curve = cascade_curve(scores, [q.weak_correct for q in test], [q.strong_correct for q in test])
    stages = [_stages(a) for a in answers]
    c_s = sum(s[0]["cost_usd"] for s in stages) / len(stages)
    escalated = [s[1]["cost_usd"] for s in stages if len(s) > 1]
    c_l = sum(escalated) / len(escalated) if escalated else 0.0
    p_accept = 1.0 - entry["strong_share"]
    formula = c_s + (1.0 - p_accept) * c_l
    from_headers = sum(float(a[0]["X-Prefixlb-Cost-USD"]) for a in answers) / len(answers)
    entry.update({
        "threshold": threshold, "apgr": apgr(curve, weak, strong), "cpt50": cpt(curve, weak, strong, 0.5),
        "cpt80": cpt(curve, weak, strong, 0.8), "tune": tune_point,
        "cost_from_headers": from_headers,
        "expected_cost": {"p_accept": p_accept, "c_s": c_s, "c_l_escalated": c_l, "c_l_mean": c_l_mean,
                          "formula": formula, "formula_with_mean_c_l": c_s + (1.0 - p_accept) * c_l_mean,
                          "relative_error": abs(formula - cost) / cost if cost else 0.0},
        "random_at_same_share": {"accuracy": random_accuracy(entry["strong_share"], weak, strong),
                                 "cost": p_accept * c_s + entry["strong_share"] * c_l_mean},
        "curve": [{"threshold": None if p.threshold == float("inf") else p.threshold,
                   "strong_share": p.strong_share, "accuracy": p.accuracy} for p in curve],
    })
    return entry


async def _evaluate(dataset: RoutingDataset, tune: list[Question], test: list[Question], client: Client,
                    verifier_url: str, seed: int) -> dict:
    weak_t, strong_t = RoutingDataset.accuracy(tune, False), RoutingDataset.accuracy(tune, True)
    chosen: dict[str, float] = {}
    tune_points: dict[str, dict] = {}
    for name in JUDGES:
        answers = await client.ask_all(f"cascade-{name}", tune, f"tune-{name}")
        curve = cascade_curve([_score(a) for a in answers], [q.weak_correct for q in tune],
                              [q.strong_correct for q in tune])
        point = best_gain_over_random(curve, weak_t, strong_t)
        chosen[name] = point.threshold
        tune_points[name] = {"accuracy": point.accuracy, "strong_share": point.strong_share,
                             "pgr": pgr(point.accuracy, weak_t, strong_t)}
    await client.admin_call("PUT", "/virtual-models", cascade_models(dataset, chosen, verifier_url))
    weak, strong = RoutingDataset.accuracy(test, False), RoutingDataset.accuracy(test, True)
    n = len(test)
    _, weak_cost = await client.measured(dataset.weak_model, test, "test-always_weak")
    _, strong_cost = await client.measured(dataset.strong_model, test, "test-always_strong")
    policies = {"always_weak": _direct_entry(test, [False] * n, weak_cost, weak, strong),
                "always_strong": _direct_entry(test, [True] * n, strong_cost, weak, strong)}
    judged = {}
    for name in JUDGES:
        answers, cost = await client.measured(f"cascade-{name}", test, f"test-{name}")
        judged[name] = _judge_entry(answers, cost, test, dataset, weak, strong, chosen[name], tune_points[name],
                                    strong_cost)
    share = judged[JUDGES[0]]["strong_share"]
    picked = set(random.Random(seed).sample(range(n), round(share * n)))
    to_strong = [q for i, q in enumerate(test) if i in picked]
    to_weak = [q for i, q in enumerate(test) if i not in picked]
    _, c_strong = await client.measured(dataset.strong_model, to_strong, "test-random") if to_strong else ([], 0.0)
    _, c_weak = await client.measured(dataset.weak_model, to_weak, "test-random") if to_weak else ([], 0.0)
    policies["random"] = {**_direct_entry(test, [i in picked for i in range(n)],
                                          (c_strong * len(to_strong) + c_weak * len(to_weak)) / n, weak, strong),
                          "matched_to": JUDGES[0], "apgr": 0.5, "cpt50": 0.5, "cpt80": 0.8,
                          "expected_accuracy": random_accuracy(share, weak, strong)}
    policies.update(judged)
    return policies


async def _run(dataset: RoutingDataset, dataset_path: str | Path, book: PriceBook, seed: int, out: Path) -> dict:
    tune, test = split_halves(dataset.questions, seed)
    verifier = web.AppRunner(verifier_app(), access_log=None)
    await verifier.setup()
    port = free_port()
    await web.TCPSite(verifier, "127.0.0.1", port).start()
    verifier_url = f"http://127.0.0.1:{port}/verify"
    out.mkdir(parents=True, exist_ok=True)
    (out / "virtual_models.yaml").write_text(yaml.safe_dump(
        {"virtual_models": cascade_models(dataset, {name: None for name in JUDGES}, verifier_url)}, sort_keys=False))
    (out / "price_book.yaml").write_text(yaml.safe_dump(price_book_yaml(book), sort_keys=False))
    try:
        fleet_cm = recorded_fleet(dataset_path, dataset.weak_model, dataset.strong_model, out / "virtual_models.yaml",
                                  out / "price_book.yaml", out / "logs")
        fleet = await asyncio.to_thread(fleet_cm.__enter__)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                client = Client(session, fleet)
                await client.wait_routable(2)
                policies = await _evaluate(dataset, tune, test, client, verifier_url, seed)
                usage = await client.admin_call("GET", "/usage")
        finally:
            await asyncio.to_thread(fleet_cm.__exit__, None, None, None)
    finally:
        await verifier.cleanup()
    return {"policies": policies, "router_usage": usage}


def run_http(dataset_path: str | Path, book: PriceBook, seed: int, out: str | Path) -> dict:
    """The summary of the evaluation of ``dataset_path`` through the real router over HTTP."""
    dataset = load_dataset(dataset_path)
    tune, test = split_halves(dataset.questions, seed)
    question_costs(test[:1], dataset, book)  # the book must price both models (ValueError) before any process starts
    result = asyncio.run(_run(dataset, dataset_path, book, seed, Path(out)))
    offline = evaluate(dataset, tune, test, book)
    return {
        "mode": "http: the real router (prefixlb router) and its cascade virtual models, in front of two "
                "recorded-answer simulated workers, over loopback HTTP",
        "dataset": str(dataset_path), "weak_model": dataset.weak_model, "strong_model": dataset.strong_model,
        "price_book": book.name, "split": {"seed": seed, "tune": len(tune), "test": len(test)},
        "test": {"weak_accuracy": RoutingDataset.accuracy(test, False),
                 "strong_accuracy": RoutingDataset.accuracy(test, True)},
        "policies": result["policies"], "router_usage": result["router_usage"], "excluded_judges": EXCLUDED_JUDGES,
        "offline_agreement": offline_agreement(result["policies"], offline),
    }


def offline_agreement(http: dict, offline: dict) -> dict:
    """HTTP minus offline, per deterministic policy (``random`` is a draw over HTTP and an
    expectation offline): accuracy, strong share, threshold, and the cost's relative difference
    (the offline replay caches nothing; over HTTP questions that begin alike share a block)."""
    out = {}
    for name, entry in http.items():
        if name == "random" or name not in offline:
            continue
        other = offline[name]
        out[name] = {"accuracy": entry["accuracy"] - other["accuracy"],
                     "strong_share": entry["strong_share"] - other["strong_share"],
                     "cost_relative": (entry["cost"] - other["cost"]) / other["cost"] if other["cost"] else 0.0}
        if "threshold" in entry:
            out[name]["same_threshold"] = entry["threshold"] == other["threshold"]
    return out
