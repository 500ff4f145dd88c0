"""Judges applied to the recorded weak answers directly (no HTTP): each question's score, the
curve, the threshold chosen on the tuning half, and every policy's numbers on the held-out
half. ``prefixlb bench cascade --offline`` writes them; the HTTP run over the router
(``http_run``) reproduces them, since every piece of the replay is deterministic (its costs
differ only by the cache hits the router's fleet really gets).

Costs are what the recorded-answer workers report: the prompt is BOS plus the chat-rendered
question in bytes (the simulated worker's byte tokenizer), the completion is the answer's
bytes plus EOS, nothing cached (the questions share no prefix). A byte is a token there, so a
bill is about four times what a BPE tokenizer would count — for both models alike: every
ratio (cascade vs always-strong, ``E[cost] = c_s + (1 − p)·c_l``) is unaffected.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Mapping, Sequence

from bench.cascade_eval.arithmetic import arithmetic_score
from bench.cascade_eval.dataset import Question, RoutingDataset
from bench.cascade_eval.metrics import (CurvePoint, apgr, best_gain_over_random, cascade_curve, cpt, pgr, point,
                                        random_accuracy)
from router.cost.price_book import PriceBook
from router.cost.pricing import Usage, price_usage
from router.virtual_models.judges.format import AllOf, RegexJudge
from router.virtual_models.judges.verdict import Candidate, Judge, Verdict, decide
from worker.engine.tokenizer import ByteTokenizer

# GSM8K answers end with "#### <number>" (the weak model's usually do, the strong one's not).
FINAL_ANSWER = r"####\s*\$?-?\d[\d,]*(?:\.\d+)?\s*\Z"
EXCLUDED_JUDGES = {
    "logprob": "the recorded answers carry no logprobs; the replay's own distribution is a point mass "
               "(p = 1 per token), so a logprob judge accepts everything here: it is evaluated on the tiny "
               "models, which compute real logprobs",
    "llm": "the recorded-answer workers can answer only the recorded questions, not a judge's rubric prompt; "
           "an LLM judge needs a model that generates",
}


@dataclass(frozen=True, slots=True)
class ArithmeticJudge:
    """The arithmetic verifier as an in-process judge (the HTTP one serves the same score)."""

    on_error: str = "escalate"
    name: str = "arithmetic"

    @property
    def needs_logprobs(self) -> bool:
        return False

    async def judge(self, candidate: Candidate) -> Verdict:
        score = arithmetic_score(candidate.answer)
        return Verdict(score == 1.0, score, self.name, "accepted" if score == 1.0 else "arithmetic_error")


def gsm8k_judges() -> dict[str, Judge]:
    """The judges that can honestly see something in a replay of recorded answers."""
    fmt = RegexJudge(FINAL_ANSWER, name="format")
    arithmetic = ArithmeticJudge()
    return {"format": fmt, "arithmetic": arithmetic, "format+arithmetic": AllOf([fmt, arithmetic], name="format+arithmetic")}


def token_counts(question: Question) -> tuple[int, int, int]:
    """(prompt tokens, weak completion tokens, strong completion tokens) as the workers count them."""
    tok = ByteTokenizer()
    prompt = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": question.prompt}])))
    return prompt, len(question.weak_answer.encode()) + 1, len(question.strong_answer.encode()) + 1


def question_costs(questions: Sequence[Question], dataset: RoutingDataset, book: PriceBook) -> list[tuple[float, float]]:
    """(weak call cost, strong call cost) per question in USD."""
    prices = {}
    for model in (dataset.weak_model, dataset.strong_model):
        price = book.get(model)
        if price is None:
            raise ValueError(f"price book {book.name!r} has no entry for {model!r}")
        prices[model] = price
    out = []
    for q in questions:
        prompt, weak_out, strong_out = token_counts(q)
        out.append((price_usage(Usage(prompt, weak_out), prices[dataset.weak_model]).total_usd,
                    price_usage(Usage(prompt, strong_out), prices[dataset.strong_model]).total_usd))
    return out


async def _scores(judge: Judge, questions: Sequence[Question], model: str) -> list[float]:
    out = []
    for q in questions:
        v = await decide(judge, Candidate(q.prompt, q.weak_answer, model))
        out.append(v.score if v.score is not None else float(v.accept))
    return out


def judge_scores(judge: Judge, questions: Sequence[Question], model: str) -> list[float]:
    """The judge's score of each question's weak answer (a failure counts as its policy says)."""
    return asyncio.run(_scores(judge, questions, model))


def _policy(escalate: Sequence[bool], questions: Sequence[Question], costs: Sequence[tuple[float, float]],
            weak: float, strong: float, cascade: bool) -> dict:
    p = point(escalate, [q.weak_correct for q in questions], [q.strong_correct for q in questions])
    n = len(questions)
    if cascade:  # the weak model always runs, the strong one on escalation
        cost = sum(cs + (cl if e else 0.0) for e, (cs, cl) in zip(escalate, costs)) / n
    else:        # a predictive router: one model per request
        cost = sum(cl if e else cs for e, (cs, cl) in zip(escalate, costs)) / n
    return {"accuracy": p.accuracy, "strong_share": p.strong_share, "cost": cost,
            "pgr": pgr(p.accuracy, weak, strong)}


def _curve_rows(points: Sequence[CurvePoint]) -> list[dict]:
    return [{"threshold": None if p.threshold == float("inf") else p.threshold, "strong_share": p.strong_share,
             "accuracy": p.accuracy} for p in points]


def evaluate_judge(judge: Judge, dataset: RoutingDataset, tune: Sequence[Question], test: Sequence[Question],
                   test_costs: Sequence[tuple[float, float]]) -> dict:
    """A judge's threshold chosen on ``tune`` (the largest gain over random routing), and its
    numbers on ``test``: accuracy, strong share, cost, APGR, CPT(50%), CPT(80%), the cost formula."""
    weak_t, strong_t = RoutingDataset.accuracy(tune, False), RoutingDataset.accuracy(tune, True)
    tune_scores = judge_scores(judge, tune, dataset.weak_model)
    tune_curve = cascade_curve(tune_scores, [q.weak_correct for q in tune], [q.strong_correct for q in tune])
    chosen = best_gain_over_random(tune_curve, weak_t, strong_t)
    weak, strong = RoutingDataset.accuracy(test, False), RoutingDataset.accuracy(test, True)
    scores = judge_scores(judge, test, dataset.weak_model)
    curve = cascade_curve(scores, [q.weak_correct for q in test], [q.strong_correct for q in test])
    escalate = [s < chosen.threshold for s in scores]
    entry = _policy(escalate, test, test_costs, weak, strong, cascade=True)
    c_s = sum(cs for cs, _ in test_costs) / len(test)
    c_l = sum(cl for _, cl in test_costs) / len(test)
    escalated = [cl for e, (_, cl) in zip(escalate, test_costs) if e]
    c_l_escalated = sum(escalated) / len(escalated) if escalated else 0.0
    accepted = 1.0 - entry["strong_share"]
    entry.update({
        "threshold": None if chosen.threshold == float("inf") else chosen.threshold,
        "apgr": apgr(curve, weak, strong), "cpt50": cpt(curve, weak, strong, 0.5), "cpt80": cpt(curve, weak, strong, 0.8),
        "tune": {"accuracy": chosen.accuracy, "strong_share": chosen.strong_share,
                 "pgr": pgr(chosen.accuracy, weak_t, strong_t)},
        "expected_cost": {"p_accept": accepted, "c_s": c_s, "c_l_escalated": c_l_escalated, "c_l_mean": c_l,
                          "formula": c_s + (1 - accepted) * c_l_escalated,
                          "formula_with_mean_c_l": c_s + (1 - accepted) * c_l},
        "random_at_same_share": {"accuracy": random_accuracy(entry["strong_share"], weak, strong),
                                 "cost": (1 - entry["strong_share"]) * c_s + entry["strong_share"] * c_l},
        "curve": _curve_rows(curve),
    })
    return entry


def evaluate(dataset: RoutingDataset, tune: Sequence[Question], test: Sequence[Question], book: PriceBook,
             judges: Mapping[str, Judge] | None = None) -> dict:
    """Every policy's entry on the held-out half (``summary["policies"]``)."""
    judges = gsm8k_judges() if judges is None else judges
    costs = question_costs(test, dataset, book)
    weak, strong = RoutingDataset.accuracy(test, False), RoutingDataset.accuracy(test, True)
    n = len(test)
    policies = {"always_weak": _policy([False] * n, test, costs, weak, strong, cascade=False),
                "always_strong": _policy([True] * n, test, costs, weak, strong, cascade=False)}
    per_judge = {name: evaluate_judge(j, dataset, tune, test, costs) for name, j in judges.items()}
    random_by_judge = {name: {"strong_share": e["strong_share"], **e["random_at_same_share"],
                              "pgr": pgr(e["random_at_same_share"]["accuracy"], weak, strong)}
                       for name, e in per_judge.items()}
    if random_by_judge:
        first = next(iter(random_by_judge))
        # The expected curve of random routing is the straight line weak -> strong: APGR 0.5,
        # CPT(x) = x exactly (RouteLLM averages ten random runs to approach the same line).
        policies["random"] = {**random_by_judge[first], "matched_to": first, "apgr": 0.5, "cpt50": 0.5,
                              "cpt80": 0.8, "by_judge": random_by_judge}
    policies.update(per_judge)
    return policies
