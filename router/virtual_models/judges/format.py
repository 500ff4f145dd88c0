"""Format validators: the answer must match a regex, or be JSON valid against a schema;
``AllOf`` combines judges (cheap checks first: it stops at the first rejection).

Regexes are operator configuration and run on model output with Python's ``re``, which has no
timeout: keep patterns free of nested quantifiers over the same text (``(a+)+``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from protocol import untrusted_json
from router.virtual_models.judges.verdict import Candidate, Judge, OnError, Verdict, decide

_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n(.*?)\n?```\s*$", re.S)


@dataclass(frozen=True, slots=True)
class RegexJudge:
    """Accept when ``pattern`` is found in the answer (``full_match``: the whole answer,
    surrounding whitespace ignored); ``must_match=False`` inverts it (reject when found)."""

    pattern: str
    full_match: bool = False
    ignore_case: bool = False
    must_match: bool = True
    on_error: OnError = "escalate"
    name: str = "regex"
    _compiled: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        flags = re.MULTILINE | (re.IGNORECASE if self.ignore_case else 0)
        try:
            object.__setattr__(self, "_compiled", re.compile(self.pattern, flags))
        except re.error as exc:
            raise ValueError(f"pattern: not a valid regular expression ({exc})") from None

    @property
    def needs_logprobs(self) -> bool:
        return False

    def evaluate(self, answer: str) -> Verdict:
        """The verdict on ``answer`` (pure)."""
        text = answer.strip() if self.full_match else answer
        found = (self._compiled.fullmatch(text) if self.full_match else self._compiled.search(text)) is not None
        accept = found == self.must_match
        reason = "accepted" if accept else ("no_match" if self.must_match else "forbidden_match")
        return Verdict(accept, 1.0 if accept else 0.0, self.name, reason)

    async def judge(self, candidate: Candidate) -> Verdict:
        return self.evaluate(candidate.answer)


@dataclass(frozen=True, slots=True)
class JsonSchemaJudge:
    """Accept when the answer is JSON valid against ``schema`` (JSON Schema, the draft the
    schema's ``$schema`` names, else 2020-12). ``allow_code_fence``: a single fenced block
    (```` ```json ... ``` ````) is unwrapped first, as models often wrap JSON."""

    schema: Mapping[str, Any]
    allow_code_fence: bool = True
    on_error: OnError = "escalate"
    name: str = "json_schema"
    _validator: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        import jsonschema

        if not isinstance(self.schema, Mapping):
            raise ValueError("schema: must be a JSON Schema object")
        cls = jsonschema.validators.validator_for(self.schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(self.schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise ValueError(f"schema: not a valid JSON Schema at {where}: {exc.message}") from None
        object.__setattr__(self, "_validator", cls(self.schema))

    @property
    def needs_logprobs(self) -> bool:
        return False

    def evaluate(self, answer: str) -> Verdict:
        """The verdict on ``answer`` (pure): ``invalid_json`` or ``schema_violation: <path>: <why>``."""
        text = answer
        if self.allow_code_fence:
            m = _FENCE.match(text)
            if m:
                text = m.group(1)
        try:
            value = untrusted_json.loads(text)
        except ValueError:
            return Verdict(False, 0.0, self.name, "invalid_json")
        try:
            error = next(iter(sorted(self._validator.iter_errors(value), key=lambda e: list(e.absolute_path))), None)
        except RecursionError:  # a recursive schema walked as deep as the answer nests: a rejection
            return Verdict(False, 0.0, self.name, "schema_violation: (root): nested too deeply to validate")
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return Verdict(False, 0.0, self.name, f"schema_violation: {where}: {error.message}")
        return Verdict(True, 1.0, self.name, "accepted")

    async def judge(self, candidate: Candidate) -> Verdict:
        return self.evaluate(candidate.answer)


@dataclass(frozen=True, slots=True)
class AllOf:
    """Accept when every judge accepts, asking them in order and stopping at the first
    rejection; the score is the lowest member score. Each member's own ``on_error`` applies."""

    judges: Sequence[Judge]
    on_error: OnError = "escalate"
    name: str = "all_of"

    def __post_init__(self) -> None:
        if not self.judges:
            raise ValueError("all_of: needs at least one judge")

    @property
    def needs_logprobs(self) -> bool:
        return any(j.needs_logprobs for j in self.judges)

    async def judge(self, candidate: Candidate) -> Verdict:
        scores: list[float] = []
        cost = 0.0
        for j in self.judges:
            v = await decide(j, candidate)
            cost += v.cost_usd
            if v.score is not None:
                scores.append(v.score)
            if not v.accept:
                return Verdict(False, min(scores) if scores else None, self.name, f"{j.name}: {v.reason}",
                               cost_usd=cost, failed=v.failed)
        return Verdict(True, min(scores) if scores else None, self.name, "accepted", cost_usd=cost)
