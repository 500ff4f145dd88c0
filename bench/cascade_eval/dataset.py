"""A routing dataset: questions with a weak and a strong model's recorded answers and whether
each is correct (RouteLLM's responses CSV), and its seeded split into two halves.

Columns: ``prompt``, ``<model>`` (True/False: the answer is correct) and ``<model>_response``
for each of the two models. The correctness columns are read here — by the evaluation, to
score outcomes — and never by the workers or the judges.
"""
from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

RESPONSE_SUFFIX = "_response"


class DatasetError(ValueError):
    """The dataset file cannot be read as a two-model routing dataset."""


@dataclass(frozen=True, slots=True)
class Question:
    """One question and both models' recorded answers and their correctness."""

    index: int
    prompt: str
    weak_answer: str
    strong_answer: str
    weak_correct: bool
    strong_correct: bool


@dataclass(frozen=True, slots=True)
class RoutingDataset:
    """Questions answered by a weak and a strong model."""

    weak_model: str
    strong_model: str
    questions: tuple[Question, ...]

    @staticmethod
    def accuracy(questions: Sequence[Question], strong: bool) -> float:
        """The share of ``questions`` the weak (or strong) model answered correctly."""
        if not questions:
            return 0.0
        return sum(q.strong_correct if strong else q.weak_correct for q in questions) / len(questions)


def _flag(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0"):
        return False
    raise DatasetError(f"{where}: expected True or False, got {value!r}")


def load_dataset(path: str | Path, weak_model: str | None = None, strong_model: str | None = None) -> RoutingDataset:
    """Read a two-model responses CSV. Without model names, the file's two models are used,
    the less accurate one as the weak model."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            fields = reader.fieldnames or []
            rows = list(reader)
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    except csv.Error as exc:
        raise DatasetError(f"{path}: not a CSV file ({exc})") from None
    models = [f[: -len(RESPONSE_SUFFIX)] for f in fields if f.endswith(RESPONSE_SUFFIX) and f[: -len(RESPONSE_SUFFIX)] in fields]
    names = [m for m in (weak_model, strong_model) if m is not None]
    if "prompt" not in fields or len(models) < 2 or any(m not in models for m in names):
        raise DatasetError(f"{path}: needs 'prompt' and, for each model, '<model>' and '<model>_response' columns "
                           f"(models found: {', '.join(models) or 'none'})")
    if weak_model is None or strong_model is None:
        if len(models) != 2:
            raise DatasetError(f"{path}: {len(models)} models; name the weak and the strong one")
        acc = {m: sum(_flag(r[m], f"{path}: {m}") for r in rows) for m in models}
        weak_model, strong_model = sorted(models, key=lambda m: acc[m])
    questions = tuple(
        Question(i, r["prompt"], r[weak_model + RESPONSE_SUFFIX], r[strong_model + RESPONSE_SUFFIX],
                 _flag(r[weak_model], f"{path}:{i + 2}"), _flag(r[strong_model], f"{path}:{i + 2}"))
        for i, r in enumerate(rows))
    if not questions:
        raise DatasetError(f"{path}: no questions")
    return RoutingDataset(weak_model, strong_model, questions)


def split_halves(questions: Sequence[Question], seed: int = 0) -> tuple[list[Question], list[Question]]:
    """A seeded shuffle cut in two: (tuning half, held-out half); the held-out half gets the
    extra question when the count is odd."""
    order = list(questions)
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    return sorted(order[:half], key=lambda q: q.index), sorted(order[half:], key=lambda q: q.index)
