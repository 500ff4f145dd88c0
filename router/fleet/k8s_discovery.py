"""Kubernetes worker discovery: watch the worker pods by label selector, keep the router's
registry in step.

A pod is a routable worker while it is Running, has an IP, is Ready, and is not being
deleted; its worker id is the pod name and its URL ``http://<pod IP>:<port>`` — exactly what
the chart makes the worker register under in Redis (``--worker-id=$(POD_NAME)``,
``--advertise=http://$(POD_IP):<port>``), so both discovery paths name the same worker.

The ``kubernetes`` client is synchronous, so :class:`PodWatcher` runs its list + watch loop in
a daemon thread; :func:`start` marshals every registry call onto the router's event loop. The
loop follows the API's list-then-watch protocol: list (the full state, and a
``resourceVersion``), reconcile, watch from that version; on ``410 Gone`` (history expired)
list again; on any other error back off and list again. Readiness flips arrive as MODIFIED
events, so a draining worker (``/health`` 503 → not Ready) leaves the registry within one
readiness period, before its pod is deleted.

Needs RBAC ``get/list/watch`` on ``pods`` in the namespace (the chart's Role).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

log = logging.getLogger("prefixlb.router.k8s_discovery")

WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; the loop re-watches
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


class WorkerSink(Protocol):
    """What discovery changes: the router's worker registry (or an adapter to it)."""

    def add_worker(self, worker_id: str, url: str) -> Any:
        """Make ``worker_id`` at ``url`` routable (idempotent; may be a coroutine)."""

    def remove_worker(self, worker_id: str) -> Any:
        """Stop routing to ``worker_id`` (idempotent; may be a coroutine)."""


@dataclass(frozen=True, slots=True)
class PodWorker:
    """A worker as discovered from one pod."""

    worker_id: str
    url: str


def pod_worker(pod: dict[str, Any], port: int, scheme: str = "http") -> PodWorker | None:
    """The worker ``pod`` (a Pod as the API's JSON dict) serves, or None if it must get no traffic."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    if not ip or not ready or not meta.get("name"):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return PodWorker(worker_id=meta["name"], url=f"{scheme}://{host}:{port}")


class PodWatcher:
    """Keeps a :class:`WorkerSink` equal to the set of ready pods matching a label selector.

    :meth:`reconcile` and :meth:`apply` are the pure state machine (tested directly with API
    event dicts); :meth:`run` drives them from the Kubernetes API.
    """

    def __init__(self, sink_call: Callable[[str, tuple], None], selector: str, namespace: str,
                 port: int, core_api: Any, watch_factory: Callable[[], Any] | None = None,
                 scheme: str = "http") -> None:
        self._call = sink_call
        self.selector = selector
        self.namespace = namespace
        self.port = port
        self.scheme = scheme
        self._core = core_api
        self._watch_factory = watch_factory or _default_watch_factory
        self._known: dict[str, str] = {}  # worker_id -> url currently in the sink
        self._stop = threading.Event()
        self._watch: Any = None
        self.resource_version: str | None = None

    @property
    def workers(self) -> dict[str, str]:
        """The workers discovery has put in the sink (id -> URL)."""
        return dict(self._known)

    def reconcile(self, pods: Iterable[dict[str, Any]]) -> None:
        """Make the sink hold exactly the routable workers among ``pods`` (a full listing)."""
        wanted: dict[str, str] = {}
        for pod in pods:
            w = pod_worker(pod, self.port, self.scheme)
            if w is not None:
                wanted[w.worker_id] = w.url
        for worker_id in sorted(set(self._known) - set(wanted)):
            self._remove(worker_id)
        for worker_id, url in sorted(wanted.items()):
            self._add(worker_id, url)

    def apply(self, event_type: str, pod: dict[str, Any]) -> None:
        """Apply one watch event (ADDED / MODIFIED / DELETED) about ``pod``."""
        name = (pod.get("metadata") or {}).get("name")
        if not name:
            return
        w = None if event_type == "DELETED" else pod_worker(pod, self.port, self.scheme)
        if w is None:
            self._remove(name)
        else:
            self._add(w.worker_id, w.url)

    def _add(self, worker_id: str, url: str) -> None:
        if self._known.get(worker_id) == url:
            return
        if worker_id in self._known:  # same pod name, new IP (a restarted StatefulSet pod)
            self._call("remove_worker", (worker_id,))
        self._known[worker_id] = url
        log.info("event=k8s_worker_added worker=%s url=%s", worker_id, url)
        self._call("add_worker", (worker_id, url))

    def _remove(self, worker_id: str) -> None:
        if self._known.pop(worker_id, None) is None:
            return
        log.info("event=k8s_worker_removed worker=%s", worker_id)
        self._call("remove_worker", (worker_id,))

    def list_pods(self) -> list[dict[str, Any]]:
        """One full listing of the matching pods; remembers its resourceVersion."""
        resp = self._core.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                              _preload_content=False)
        body = json.loads(resp.data)
        self.resource_version = (body.get("metadata") or {}).get("resourceVersion")
        return list(body.get("items") or [])

    def watch_once(self) -> None:
        """Watch from the last resourceVersion until the server ends the watch or stop()."""
        self._watch = self._watch_factory()
        for event in self._watch.stream(self._core.list_namespaced_pod, self.namespace,
                                        label_selector=self.selector,
                                        resource_version=self.resource_version,
                                        timeout_seconds=WATCH_TIMEOUT_S):
            if self._stop.is_set():
                break
            kind = event.get("type")
            obj = event.get("raw_object") or {}
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self.apply(kind, obj)
            if version:
                self.resource_version = version

    def run(self) -> None:
        """List, reconcile, watch; repeat until :meth:`stop`. Never raises."""
        failures = 0
        relist = True
        while not self._stop.is_set():
            try:
                if relist:
                    self.reconcile(self.list_pods())
                    relist = False
                self.watch_once()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - the loop must survive any API error
                gone = getattr(exc, "status", None) == 410
                relist = True
                if gone:  # watch history expired: a fresh listing is the only correct resume
                    log.info("event=k8s_watch_expired selector=%s", self.selector)
                    continue
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                log.warning("event=k8s_watch_error selector=%s error=%r retry_in_s=%s",
                            self.selector, exc, delay)
                self._stop.wait(delay)

    def stop(self) -> None:
        """Ask :meth:`run` to return (it unblocks the current watch)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()


def _default_watch_factory() -> Any:
    from kubernetes import watch

    return watch.Watch()


def _default_core_api() -> Any:
    """A CoreV1Api from the pod's service account (in cluster) or ~/.kube/config (outside)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


class Discovery:
    """A running :class:`PodWatcher` thread; :meth:`stop` ends it."""

    def __init__(self, watcher: PodWatcher, thread: threading.Thread) -> None:
        self.watcher = watcher
        self._thread = thread

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; the registry keeps the workers it has."""
        self.watcher.stop()
        self._thread.join(timeout)


def start(registry: WorkerSink, selector: str, namespace: str, port: int = 8000,
          core_api: Any = None, watch_factory: Callable[[], Any] | None = None,
          loop: asyncio.AbstractEventLoop | None = None, scheme: str = "http") -> Discovery:
    """Start discovering workers: pods matching ``selector`` in ``namespace`` join ``registry``.

    Call it from the router's event loop (e.g. an aiohttp ``on_startup`` hook): registry calls
    are then made on that loop (coroutines are scheduled as tasks), never from the watch thread.
    Outside a running loop, the calls are made directly from the watch thread.
    """
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None

    def invoke(method: str, args: tuple) -> None:
        result = getattr(registry, method)(*args)
        if inspect.isawaitable(result):
            asyncio.ensure_future(result)

    def sink_call(method: str, args: tuple) -> None:
        if loop is None:
            result = getattr(registry, method)(*args)
            if inspect.isawaitable(result):
                raise TypeError("an async registry needs start() to be called from its event loop")
        else:
            loop.call_soon_threadsafe(invoke, method, args)

    watcher = PodWatcher(sink_call, selector, namespace, port,
                         core_api if core_api is not None else _default_core_api(),
                         watch_factory, scheme)
    thread = threading.Thread(target=watcher.run, name="k8s-discovery", daemon=True)
    thread.start()
    log.info("event=k8s_discovery_started namespace=%s selector=%s port=%d", namespace, selector, port)
    return Discovery(watcher, thread)
