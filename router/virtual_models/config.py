"""The ``virtual_models`` schema (YAML), validated with errors that name the bad key.

::

    virtual_models:
      auto:                                # predictive: one inference per request
        route:
          default: small
          rules:                           # first match wins; every condition of a rule must hold
            - model: large
              when: {min_prompt_chars: 4000}
            - model: large
              when: {keywords: [prove, derive], tools: true}
            - model: large
              when: {header: {name: x-tier, equals: premium}}
          classifier:                      # asked only when no rule matched
            url: http://classifier:9000/score
            threshold: 0.6                 # score >= threshold -> above, else below
            above: large
            below: small                   # default: the route's default
            timeout_s: 0.2
            on_error: below                # which side answers when the classifier fails
      smart:                               # cascade: small first, large when the judge rejects
        cascade:
          stages:
            - model: small
              judge: {kind: logprob, quantile: 0.1, threshold: 0.5, on_error: escalate}
            - model: large                 # the last stage answers unjudged
          max_escalations: 1

Rule conditions: ``min_prompt_chars`` / ``max_prompt_chars`` (characters of every message,
or of the prompt), ``keywords`` (any of them, case-insensitive substring), ``regex`` (Python
``re.search``), ``tools`` (true: the request has tools; false: it has none), ``header``
(``name`` plus one of ``equals``, ``matches`` (regex) or ``present: true``).

Judge kinds (``kind``): ``logprob`` (``threshold``, ``quantile``), ``regex`` (``pattern``,
``full_match``, ``ignore_case``, ``must_match``), ``json_schema`` (``schema``,
``allow_code_fence``), ``verifier`` (``url``, ``timeout_s``, ``threshold``, ``headers``,
``include_messages``), ``llm`` (``model``, ``rubric``, ``threshold``, ``scale``,
``max_tokens``), ``all_of`` (``judges``: a list). Every judge takes ``on_error`` (accept |
escalate | fail, default escalate) and ``name``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from router.virtual_models.judges.format import JsonSchemaJudge, RegexJudge
from router.virtual_models.judges.verdict import ON_ERROR
from router.yaml_file import read_yaml

JUDGE_KEYS: dict[str, set[str]] = {
    "logprob": {"threshold", "quantile"},
    "regex": {"pattern", "full_match", "ignore_case", "must_match"},
    "json_schema": {"schema", "allow_code_fence"},
    "verifier": {"url", "timeout_s", "threshold", "headers", "include_messages"},
    "llm": {"model", "rubric", "threshold", "scale", "max_tokens"},
    "all_of": {"judges"},
}
_COMMON_JUDGE_KEYS = {"kind", "on_error", "name"}
_WHEN_KEYS = {"min_prompt_chars", "max_prompt_chars", "keywords", "regex", "tools", "header"}


class VirtualModelError(ValueError):
    """The virtual-model configuration is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class JudgeSpec:
    """A validated judge configuration (built into a judge by ``build_judge``)."""

    kind: str
    options: Mapping[str, Any]
    on_error: str = "escalate"
    name: str = ""
    members: tuple["JudgeSpec", ...] = ()

    @property
    def needs_logprobs(self) -> bool:
        """True when the stage must return token logprobs for this judge."""
        return self.kind == "logprob" or any(m.needs_logprobs for m in self.members)


@dataclass(frozen=True, slots=True)
class CascadeStage:
    """One stage: a real model and the judge of its answer (None: the last stage)."""

    model: str
    judge: JudgeSpec | None = None


@dataclass(frozen=True, slots=True)
class CascadeModel:
    """Stages tried in order; at most ``max_escalations`` escalations per request."""

    name: str
    stages: tuple[CascadeStage, ...]
    max_escalations: int


@dataclass(frozen=True, slots=True)
class HeaderCondition:
    """A request header (lower-cased ``name``) equals a value, matches a regex, or is present."""

    name: str
    equals: str | None = None
    matches: re.Pattern | None = None


@dataclass(frozen=True, slots=True)
class RouteRule:
    """Send to ``model`` when every given condition holds."""

    model: str
    min_prompt_chars: int | None = None
    max_prompt_chars: int | None = None
    keywords: tuple[str, ...] = ()
    regex: re.Pattern | None = None
    tools: bool | None = None
    header: HeaderCondition | None = None


@dataclass(frozen=True, slots=True)
class ClassifierSpec:
    """An HTTP classifier ``{prompt} -> {score}``: ``score >= threshold`` -> ``above``."""

    url: str
    threshold: float
    above: str
    below: str
    timeout_s: float = 0.5
    on_error: str = "below"


@dataclass(frozen=True, slots=True)
class RouteModel:
    """Rules first (in order), then the classifier if any, else ``default``."""

    name: str
    default: str
    rules: tuple[RouteRule, ...] = ()
    classifier: ClassifierSpec | None = None


VirtualModel = RouteModel | CascadeModel


def _err(where: str, message: str) -> VirtualModelError:
    return VirtualModelError(f"{where}: {message}")


def _mapping(where: str, value: Any, allowed: set[str], required: set[str] = frozenset()) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _err(where, f"expected a mapping, got {type(value).__name__}")
    extra = sorted(set(value) - allowed)
    if extra:
        raise _err(where, f"unknown key(s) {', '.join(map(repr, extra))} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(value))
    if missing:
        raise _err(where, f"missing {', '.join(map(repr, missing))}")
    return value


def _str(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _err(where, f"expected a non-empty string, got {value!r}")
    return value


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _err(where, f"expected true or false, got {value!r}")
    return value


def _num(where: str, value: Any, lo: float | None = None, hi: float | None = None, strict_lo: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _err(where, f"expected a number, got {value!r}")
    if lo is not None and (value < lo or (strict_lo and value == lo)):
        raise _err(where, f"must be {'>' if strict_lo else '>='} {lo:g}, got {value!r}")
    if hi is not None and value > hi:
        raise _err(where, f"must be <= {hi:g}, got {value!r}")
    return float(value)


def _int(where: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _err(where, f"expected an integer >= {lo}, got {value!r}")
    return value


def _regex(where: str, value: Any) -> re.Pattern:
    try:
        return re.compile(_str(where, value))
    except re.error as exc:
        raise _err(where, f"not a valid regular expression ({exc})") from None


def _url(where: str, value: Any) -> str:
    url = _str(where, value)
    if not re.match(r"^https?://[^/\s]+", url):
        raise _err(where, f"expected an http(s) URL, got {url!r}")
    return url


def parse_judge(where: str, value: Any) -> JudgeSpec:
    """Validate one judge configuration."""
    if not isinstance(value, Mapping) or "kind" not in value:
        raise _err(where, f"a judge needs a 'kind' ({', '.join(JUDGE_KEYS)})")
    kind = value["kind"]
    if kind not in JUDGE_KEYS:
        raise _err(f"{where}.kind", f"unknown judge kind {kind!r} (known: {', '.join(JUDGE_KEYS)})")
    _mapping(where, value, JUDGE_KEYS[kind] | _COMMON_JUDGE_KEYS)
    on_error = value.get("on_error", "escalate")
    if on_error not in ON_ERROR:
        raise _err(f"{where}.on_error", f"must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    name = _str(f"{where}.name", value["name"]) if "name" in value else kind
    opts = {k: v for k, v in value.items() if k not in _COMMON_JUDGE_KEYS}
    members: tuple[JudgeSpec, ...] = ()
    try:
        if kind == "logprob":
            opts = {"threshold": _num(f"{where}.threshold", opts.get("threshold"), 0.0, 1.0),
                    "quantile": _num(f"{where}.quantile", opts.get("quantile", 0.1), 0.0, 1.0)}
        elif kind == "regex":
            _str(f"{where}.pattern", opts.get("pattern"))
            for key in ("full_match", "ignore_case", "must_match"):
                if key in opts:
                    _bool(f"{where}.{key}", opts[key])
            RegexJudge(**opts)
        elif kind == "json_schema":
            if "allow_code_fence" in opts:
                _bool(f"{where}.allow_code_fence", opts["allow_code_fence"])
            if "schema" not in opts:
                raise _err(where, "missing 'schema'")
            JsonSchemaJudge(**opts)
        elif kind == "verifier":
            opts["url"] = _url(f"{where}.url", opts.get("url"))
            opts["timeout_s"] = _num(f"{where}.timeout_s", opts.get("timeout_s", 1.0), 0.0, strict_lo=True)
            if opts.get("threshold") is not None:
                opts["threshold"] = _num(f"{where}.threshold", opts["threshold"])
            headers = opts.get("headers", {})
            if not isinstance(headers, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in headers.items()):
                raise _err(f"{where}.headers", "expected a mapping of header names to strings")
            if "include_messages" in opts:
                _bool(f"{where}.include_messages", opts["include_messages"])
        elif kind == "llm":
            _str(f"{where}.model", opts.get("model"))
            _str(f"{where}.rubric", opts.get("rubric"))
            opts["threshold"] = _num(f"{where}.threshold", opts.get("threshold", 0.7), 0.0, 1.0)
            opts["scale"] = _int(f"{where}.scale", opts.get("scale", 10), 1)
            opts["max_tokens"] = _int(f"{where}.max_tokens", opts.get("max_tokens", 8), 1)
        else:  # all_of
            judges = opts.get("judges")
            if not isinstance(judges, list) or not judges:
                raise _err(f"{where}.judges", "expected a non-empty list of judges")
            members = tuple(parse_judge(f"{where}.judges[{i}]", j) for i, j in enumerate(judges))
            opts = {}
    except ValueError as exc:
        if isinstance(exc, VirtualModelError):
            raise
        raise _err(where, str(exc)) from None
    return JudgeSpec(kind, opts, on_error, name, members)


def _cascade(where: str, name: str, value: Any, virtual: set[str]) -> CascadeModel:
    spec = _mapping(where, value, {"stages", "max_escalations"}, {"stages"})
    stages_raw = spec["stages"]
    if not isinstance(stages_raw, list) or len(stages_raw) < 2:
        raise _err(f"{where}.stages", "a cascade needs a list of at least two stages")
    stages = []
    for i, raw in enumerate(stages_raw):
        at = f"{where}.stages[{i}]"
        stage = _mapping(at, raw, {"model", "judge"}, {"model"})
        model = _str(f"{at}.model", stage["model"])
        if model in virtual:
            raise _err(f"{at}.model", f"{model!r} is a virtual model; stages must be real models")
        last = i == len(stages_raw) - 1
        if last and "judge" in stage:
            raise _err(f"{at}.judge", "the last stage's answer is always returned: a judge there has nowhere "
                                      "to escalate")
        if not last and "judge" not in stage:
            raise _err(at, "every stage but the last needs a 'judge'")
        stages.append(CascadeStage(model, None if last else parse_judge(f"{at}.judge", stage["judge"])))
    most = len(stages) - 1
    cap = _int(f"{where}.max_escalations", spec.get("max_escalations", most), 0)
    if cap > most:
        raise _err(f"{where}.max_escalations", f"at most {most} with {len(stages)} stages, got {cap}")
    return CascadeModel(name, tuple(stages), cap)


def _rule(where: str, value: Any, virtual: set[str]) -> RouteRule:
    raw = _mapping(where, value, {"model", "when"}, {"model", "when"})
    model = _target(f"{where}.model", raw["model"], virtual)
    when = _mapping(f"{where}.when", raw["when"], _WHEN_KEYS)
    if not when:
        raise _err(f"{where}.when", "needs at least one condition")
    at = f"{where}.when"
    kw = when.get("keywords", [])
    if not isinstance(kw, list) or not all(isinstance(k, str) and k for k in kw):
        raise _err(f"{at}.keywords", "expected a list of non-empty strings")
    header = None
    if "header" in when:
        h = _mapping(f"{at}.header", when["header"], {"name", "equals", "matches", "present"}, {"name"})
        tests = [k for k in ("equals", "matches", "present") if k in h]
        if len(tests) != 1:
            raise _err(f"{at}.header", "give exactly one of 'equals', 'matches', 'present'")
        if "present" in h and h["present"] is not True:
            raise _err(f"{at}.header.present", "only 'present: true' is meaningful")
        header = HeaderCondition(_str(f"{at}.header.name", h["name"]).lower(),
                                 _str(f"{at}.header.equals", h["equals"]) if "equals" in h else None,
                                 _regex(f"{at}.header.matches", h["matches"]) if "matches" in h else None)
    lo = _int(f"{at}.min_prompt_chars", when["min_prompt_chars"], 0) if "min_prompt_chars" in when else None
    hi = _int(f"{at}.max_prompt_chars", when["max_prompt_chars"], 0) if "max_prompt_chars" in when else None
    if lo is not None and hi is not None and lo > hi:
        raise _err(at, f"min_prompt_chars ({lo}) exceeds max_prompt_chars ({hi})")
    return RouteRule(model, lo, hi, tuple(k.lower() for k in kw),
                     _regex(f"{at}.regex", when["regex"]) if "regex" in when else None,
                     _bool(f"{at}.tools", when["tools"]) if "tools" in when else None, header)


def _target(where: str, value: Any, virtual: set[str]) -> str:
    model = _str(where, value)
    if model in virtual:
        raise _err(where, f"{model!r} is a virtual model; a route must name a real model")
    return model


def _route(where: str, name: str, value: Any, virtual: set[str]) -> RouteModel:
    spec = _mapping(where, value, {"default", "rules", "classifier"}, {"default"})
    default = _target(f"{where}.default", spec["default"], virtual)
    rules_raw = spec.get("rules", [])
    if not isinstance(rules_raw, list):
        raise _err(f"{where}.rules", "expected a list of rules")
    rules = tuple(_rule(f"{where}.rules[{i}]", r, virtual) for i, r in enumerate(rules_raw))
    classifier = None
    if "classifier" in spec:
        at = f"{where}.classifier"
        c = _mapping(at, spec["classifier"], {"url", "threshold", "above", "below", "timeout_s", "on_error"},
                     {"url", "threshold", "above"})
        on_error = c.get("on_error", "below")
        if on_error not in ("below", "above"):
            raise _err(f"{at}.on_error", f"must be 'below' or 'above', got {on_error!r}")
        classifier = ClassifierSpec(
            _url(f"{at}.url", c["url"]), _num(f"{at}.threshold", c["threshold"]),
            _target(f"{at}.above", c["above"], virtual),
            _target(f"{at}.below", c["below"], virtual) if "below" in c else default,
            _num(f"{at}.timeout_s", c.get("timeout_s", 0.5), 0.0, strict_lo=True), on_error)
    if not rules and classifier is None:
        raise _err(where, "a route needs 'rules' or a 'classifier' (else name the default model directly)")
    return RouteModel(name, default, rules, classifier)


def parse_virtual_models(data: Any, where: str = "virtual_models") -> dict[str, VirtualModel]:
    """Validate a ``virtual_models`` mapping: ``{name: {route: ...} | {cascade: ...}}``."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise _err(where, f"expected a mapping of model name to definition, got {type(data).__name__}")
    virtual = {str(k) for k in data}
    out: dict[str, VirtualModel] = {}
    for name, definition in data.items():
        at = f"{where}.{name}"
        _str(at, name)
        spec = _mapping(at, definition, {"route", "cascade"})
        if len(spec) != 1:
            raise _err(at, "give exactly one of 'route' or 'cascade'")
        if "route" in spec:
            out[name] = _route(f"{at}.route", name, spec["route"], virtual)
        else:
            out[name] = _cascade(f"{at}.cascade", name, spec["cascade"], virtual)
    return out


def load_virtual_models(path: str | Path) -> dict[str, VirtualModel]:
    """Read ``virtual_models`` from a YAML file (the key itself, or a file holding only it)."""
    data = read_yaml(path, VirtualModelError, "virtual models")
    if isinstance(data, Mapping) and "virtual_models" in data:
        data = data["virtual_models"]
    return parse_virtual_models(data)

