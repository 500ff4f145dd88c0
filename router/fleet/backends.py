"""Backends of several kinds behind one router: how a worker is named on the command line.

A worker has a *kind* (design.md section 8), which decides how the router probes it, where its
load comes from and where its prefix knowledge comes from:

=========  ===========================  ==========================================  =====================================
kind       liveness                     load                                        prefix knowledge
=========  ===========================  ==========================================  =====================================
prefixlb   ``GET /load`` (a LoadReport)  the LoadReport                               its KV events (Redis) + feedback
vllm       ``GET /health``               ``GET /metrics`` (``vllm:*``)                ZMQ KV events (precise) + feedback
sglang     ``GET /health``               ``GET /metrics`` (``sglang:*``)              ``cached_tokens`` feedback
openai     ``GET /health``               the router's own in-flight bookkeeping       ``cached_tokens`` feedback, if any
=========  ===========================  ==========================================  =====================================

Without a kind the prober detects it (``router/fleet/health.py``): a valid LoadReport on
``/load`` is a prefixlb worker; otherwise ``/metrics`` says ``vllm:`` or ``sglang:``; a server
that answers ``/health`` and neither is ``openai`` (any OpenAI-compatible server).

A worker spec, as ``--worker``, the admin API and Helm values take it::

    [KIND=]URL[,kv-events=ENDPOINT][,kv-replay=ENDPOINT]

    http://10.0.0.5:8000                                   kind detected
    vllm=http://10.0.0.5:8000                              kind given
    vllm=http://10.0.0.5:8000,kv-events=tcp://10.0.0.5:5557,kv-replay=tcp://10.0.0.5:5558

``kv-events`` is the ZMQ endpoint of vLLM's KV-event publisher (its ``--kv-events-config``
``endpoint`` with ``*`` replaced by the server's address), ``kv-replay`` its replay socket; the
router subscribes to them itself (``router/fleet/kv_subscriber.py``). Endpoints are ``tcp://HOST:PORT``
and their host must pass the same allow-list as worker URLs.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from router.fleet.engine_metrics import ENGINE_KINDS, SGLANG, VLLM  # ENGINE_KINDS: load from /metrics

PREFIXLB = "prefixlb"
OPENAI = "openai"
BACKEND_KINDS = (PREFIXLB, VLLM, SGLANG, OPENAI)

__all__ = ["PREFIXLB", "VLLM", "SGLANG", "OPENAI", "BACKEND_KINDS", "ENGINE_KINDS", "WorkerSpec",
           "InvalidWorkerSpec", "parse_worker_spec", "worker_spec", "check_zmq_endpoint"]

_OPTIONS = ("kv-events", "kv-replay")


class InvalidWorkerSpec(ValueError):
    """A worker spec that cannot be read (unknown kind or option, bad endpoint)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec:
    """One worker as configured: its base URL, its kind (None: detect) and its KV-event sockets."""

    url: str
    kind: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None

    def __str__(self) -> str:
        text = f"{self.kind}={self.url}" if self.kind else self.url
        if self.kv_events:
            text += f",kv-events={self.kv_events}"
        if self.kv_replay:
            text += f",kv-replay={self.kv_replay}"
        return text


def check_zmq_endpoint(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://HOST:PORT`` endpoint; raises InvalidWorkerSpec otherwise.

    Only TCP: the router connects to a publisher; ``*`` (bind on every interface) is the
    publisher's side and makes no sense here.
    """
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise InvalidWorkerSpec(f"KV-event endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname
    if not host or host == "*" or port is None or port == 0 or parts.path or parts.query or parts.username:
        raise InvalidWorkerSpec(f"KV-event endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    return host, port


def parse_worker_spec(text: str) -> WorkerSpec:
    """Read ``[KIND=]URL[,kv-events=ENDPOINT][,kv-replay=ENDPOINT]`` (see the module docstring).

    The URL itself is checked by the registry's URL policy when the worker is added.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidWorkerSpec("empty worker spec")
    first, *rest = [part.strip() for part in text.strip().split(",")]
    kind = None
    head, sep, tail = first.partition("=")
    if sep and "://" not in head:
        kind, url = head.strip(), tail.strip()
    else:
        url = first
    options: dict[str, str] = {}
    for part in rest:
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in _OPTIONS:
            raise InvalidWorkerSpec(f"unknown worker option {part!r} (options: {', '.join(_OPTIONS)})")
        if name in options:
            raise InvalidWorkerSpec(f"worker option {name} given twice")
        options[name] = value.strip()
    return worker_spec(url, kind, options.get("kv-events"), options.get("kv-replay"))


def worker_spec(url: str, kind: str | None = None, kv_events: str | None = None,
                kv_replay: str | None = None) -> WorkerSpec:
    """A checked :class:`WorkerSpec` (the same rules as :func:`parse_worker_spec`; the admin API
    takes the parts as fields)."""
    if kind is not None:
        kind = kind.lower()
        if kind not in BACKEND_KINDS:
            raise InvalidWorkerSpec(f"unknown worker kind {kind!r} (one of {', '.join(BACKEND_KINDS)})")
    for endpoint in (kv_events, kv_replay):
        if endpoint is not None:
            check_zmq_endpoint(endpoint)
    if (kv_events or kv_replay) and kind not in (None, VLLM, SGLANG):
        raise InvalidWorkerSpec(f"KV-event sockets are for vllm or sglang workers, not {kind}")
    if kv_replay and not kv_events:
        raise InvalidWorkerSpec("kv-replay needs kv-events")
    return WorkerSpec(url=url, kind=kind, kv_events=kv_events, kv_replay=kv_replay)
