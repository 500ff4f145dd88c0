"""RecordedAnswers: the answers one model gave to a fixed set of prompts, read from a CSV.

The simulated worker's recorded-answer mode (``--sim-answers FILE --sim-answers-model M``)
answers each prompt with the text model ``M`` recorded for it, so a router and its cascades
run end to end on real model outputs. The CSV needs a ``prompt`` column and a
``<M>_response`` column (RouteLLM's layout, ``datasets/routellm_gsm8k_responses.csv``); only
those two are read — never the columns saying whether an answer is correct, so nothing the
worker returns can carry the label a judge is evaluated against.

A request matches a recorded prompt when its question — the completion prompt, or the last
user message of a chat rendered by the default chat template — equals it, surrounding
whitespace ignored. A prompt that merely *contains* a recorded question (a judge's rubric
quoting it) does not match: the worker refuses it rather than answer with text the model
never gave to that prompt.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Mapping

PROMPT_COLUMN = "prompt"
RESPONSE_SUFFIX = "_response"
# The default chat template (worker/engine/chat_template.py): the simulated worker's only one.
_USER = "<|user|>\n"
_END = "<|end|>\n"
_GENERATION_PROMPT = "<|assistant|>\n"


class RecordedAnswersError(ValueError):
    """The answers file is unreadable or lacks the model's column."""


def question_of(prompt_text: str) -> str:
    """The question a rendered prompt asks: the last user message of a chat prompt (default
    template, ending with the generation prompt), else the whole text; whitespace stripped."""
    if prompt_text.endswith(_GENERATION_PROMPT):
        start = prompt_text.rfind(_USER)
        if start != -1:
            start += len(_USER)
            end = prompt_text.find(_END, start)
            return prompt_text[start:end if end != -1 else len(prompt_text)].strip()
    return prompt_text.strip()


class RecordedAnswers:
    """Recorded answers of ``model`` by question (see the module docstring)."""

    def __init__(self, model: str, answers: Mapping[str, str]) -> None:
        self.model = model
        self._answers = {q.strip(): a for q, a in answers.items()}

    @classmethod
    def from_csv(cls, path: str | Path, model: str) -> "RecordedAnswers":
        """Read the ``prompt`` and ``<model>_response`` columns of ``path``."""
        column = model + RESPONSE_SUFFIX
        try:
            with open(path, encoding="utf-8", newline="") as fh:
                reader = csv.DictReader(fh)
                fields = reader.fieldnames or []
                if PROMPT_COLUMN not in fields or column not in fields:
                    models = [f[: -len(RESPONSE_SUFFIX)] for f in fields if f.endswith(RESPONSE_SUFFIX)]
                    raise RecordedAnswersError(
                        f"{path}: needs columns {PROMPT_COLUMN!r} and {column!r} (models in this file: "
                        f"{', '.join(models) or 'none'})")
                answers: dict[str, str] = {}
                for row in reader:
                    question = (row[PROMPT_COLUMN] or "").strip()
                    if question in answers:
                        raise RecordedAnswersError(f"{path}:{reader.line_num}: prompt recorded twice")
                    answers[question] = row[column] or ""
        except OSError as exc:
            raise RecordedAnswersError(f"cannot read {path}: {exc}") from None
        except csv.Error as exc:
            raise RecordedAnswersError(f"{path}: not a CSV file ({exc})") from None
        return cls(model, answers)

    def __len__(self) -> int:
        return len(self._answers)

    def find(self, prompt_text: str) -> str | None:
        """The recorded answer to the question ``prompt_text`` asks, or None."""
        return self._answers.get(question_of(prompt_text))
