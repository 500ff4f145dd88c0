"""Kubernetes worker discovery (router/fleet/k8s_discovery.py).

The Kubernetes API is something we neither own nor can run here, so its pods endpoint is
replaced by :class:`FakePodApi`, which speaks the API server's wire format (a PodList JSON
body for a listing; newline-delimited watch events, resumable from a resourceVersion, with
``410 Gone`` when history expired). Everything above it is real: the ``kubernetes`` client's
own ``Watch`` parses and deserializes the stream, and the watcher runs in its thread.
"""
from __future__ import annotations

import asyncio
import copy
import json
import queue
import threading

from router.fleet.k8s_discovery import PodWatcher, PodWorker, pod_worker, start
from tests.support import wait_for

SELECTOR = "app.kubernetes.io/component=worker"


def make_pod(name: str, ip: str | None = "10.0.0.1", phase: str = "Running", ready: bool = True,
             deleting: bool = False) -> dict:
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "labels": {"app.kubernetes.io/component": "worker"}},
        "spec": {"containers": [{"name": "worker", "image": "prefixlb-worker:0.1.0"}]},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }
    if ip:
        pod["status"]["podIP"] = ip
    if deleting:
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return pod


class _Sock:
    def __init__(self, lines: queue.Queue) -> None:
        self._lines = lines

    def shutdown(self, how: int) -> None:
        self._lines.put(None)


class _Conn:
    def __init__(self, lines: queue.Queue) -> None:
        self.sock = _Sock(lines)


class _WatchResponse:
    """A streaming HTTP response: yields the watch's JSON lines as they are produced."""

    status = 200

    def __init__(self, lines: queue.Queue) -> None:
        self._lines = lines
        self.connection = _Conn(lines)

    def stream(self, amt=None, decode_content=False):
        while True:
            line = self._lines.get()
            if line is None:
                return
            yield line

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class _ListResponse:
    status = 200

    def __init__(self, data: bytes) -> None:
        self.data = data


class FakePodApi:
    """The pods endpoint of a Kubernetes API server, in memory."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.version = 100
        self.history: list[tuple[int, str, dict]] = []  # (resourceVersion, type, pod)
        self.oldest_watchable = 0
        self.lists = 0
        self.watches: list[queue.Queue] = []
        self.lock = threading.Lock()

    def list_namespaced_pod(self, namespace, label_selector=None, watch=False, _preload_content=True,
                            resource_version=None, timeout_seconds=None, **kwargs):
        """List or watch pods.

        :rtype: V1PodList
        """
        assert namespace == "llm" and label_selector == SELECTOR
        with self.lock:
            if not watch:
                self.lists += 1
                body = {"apiVersion": "v1", "kind": "PodList",
                        "metadata": {"resourceVersion": str(self.version)},
                        "items": [copy.deepcopy(p) for p in self.pods.values()]}
                return _ListResponse(json.dumps(body).encode())
            lines: queue.Queue = queue.Queue()
            since = int(resource_version or 0)
            if since < self.oldest_watchable:
                lines.put(self._line("ERROR", {"kind": "Status", "code": 410, "reason": "Expired",
                                               "message": "too old resource version"}))
                lines.put(None)
            else:
                for version, kind, pod in self.history:
                    if version > since:
                        lines.put(self._line(kind, pod))
                self.watches.append(lines)
            return _WatchResponse(lines)

    @staticmethod
    def _line(kind: str, obj: dict) -> bytes:
        return (json.dumps({"type": kind, "object": obj}) + "\n").encode()

    def emit(self, kind: str, pod: dict) -> None:
        """A pod change, as the API server records and broadcasts it."""
        with self.lock:
            self.version += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.pods.pop(pod["metadata"]["name"], None)
            else:
                self.pods[pod["metadata"]["name"]] = pod
            self.history.append((self.version, kind, pod))
            for lines in self.watches:
                lines.put(self._line(kind, pod))

    def change_unseen(self, kind: str, pod: dict) -> None:
        """A pod change whose event is compacted away before any watch could see it."""
        with self.lock:
            self.version += 1
            if kind == "DELETED":
                self.pods.pop(pod["metadata"]["name"], None)
            else:
                self.pods[pod["metadata"]["name"]] = copy.deepcopy(pod)

    def expire_history(self) -> None:
        """Compaction: every open watch ends, and resuming from an old version gets 410 Gone."""
        with self.lock:
            self.oldest_watchable = self.version + 1
            for lines in self.watches:
                lines.put(None)
            self.watches.clear()


class RecordingRegistry:
    """A registry that records the calls discovery makes (and on which thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.workers: dict[str, str] = {}
        self.threads: set[int] = set()

    def add_worker(self, worker_id: str, url: str) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("add", worker_id, url))
        self.workers[worker_id] = url

    def remove_worker(self, worker_id: str) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("remove", worker_id))
        self.workers.pop(worker_id, None)


def test_a_running_ready_pod_is_a_worker_named_after_the_pod_at_its_ip():
    assert pod_worker(make_pod("w-0", "10.0.0.7"), 8000) == PodWorker("w-0", "http://10.0.0.7:8000")
    assert pod_worker(make_pod("w-1", "fd00::7"), 9000) == PodWorker("w-1", "http://[fd00::7]:9000")


def test_pods_that_must_not_get_traffic_are_not_workers():
    assert pod_worker(make_pod("w", phase="Pending"), 8000) is None
    assert pod_worker(make_pod("w", ready=False), 8000) is None  # starting, or draining (/health 503)
    assert pod_worker(make_pod("w", ip=None), 8000) is None
    assert pod_worker(make_pod("w", deleting=True), 8000) is None
    assert pod_worker(make_pod("w", phase="Failed"), 8000) is None


def _watcher(registry: RecordingRegistry) -> PodWatcher:
    return PodWatcher(lambda method, args: getattr(registry, method)(*args), SELECTOR, "llm", 8000,
                      core_api=None)


def test_reconcile_adds_ready_pods_and_removes_workers_whose_pods_are_gone():
    registry = RecordingRegistry()
    watcher = _watcher(registry)
    watcher.reconcile([make_pod("w-0", "10.0.0.1"), make_pod("w-1", "10.0.0.2", ready=False)])
    watcher.reconcile([make_pod("w-1", "10.0.0.2"), make_pod("w-2", "10.0.0.3")])
    assert registry.calls == [
        ("add", "w-0", "http://10.0.0.1:8000"),
        ("remove", "w-0"),
        ("add", "w-1", "http://10.0.0.2:8000"),
        ("add", "w-2", "http://10.0.0.3:8000"),
    ]


def test_events_follow_readiness_and_a_restarted_pod_rejoins_at_its_new_ip():
    registry = RecordingRegistry()
    watcher = _watcher(registry)
    watcher.apply("ADDED", make_pod("w-0", "10.0.0.1", ready=False))
    watcher.apply("MODIFIED", make_pod("w-0", "10.0.0.1"))
    watcher.apply("MODIFIED", make_pod("w-0", "10.0.0.1"))  # no change: no call
    watcher.apply("MODIFIED", make_pod("w-0", "10.0.0.1", ready=False))  # draining
    watcher.apply("MODIFIED", make_pod("w-0", "10.0.0.9"))  # same StatefulSet name, new pod IP
    watcher.apply("MODIFIED", make_pod("w-0", "10.0.0.5"))
    watcher.apply("DELETED", make_pod("w-0", "10.0.0.5"))
    watcher.apply("DELETED", make_pod("w-0", "10.0.0.5"))  # already gone: no call
    assert registry.calls == [
        ("add", "w-0", "http://10.0.0.1:8000"),
        ("remove", "w-0"),
        ("add", "w-0", "http://10.0.0.9:8000"),
        ("remove", "w-0"),
        ("add", "w-0", "http://10.0.0.5:8000"),
        ("remove", "w-0"),
    ]


def test_discovery_tracks_the_pods_through_the_real_kubernetes_watch_client():
    api = FakePodApi()
    api.emit("ADDED", make_pod("w-0", "10.0.0.1"))
    api.emit("ADDED", make_pod("w-1", "10.0.0.2", ready=False))
    registry = RecordingRegistry()
    discovery = start(registry, SELECTOR, "llm", port=8000, core_api=api)
    try:
        wait_for(lambda: registry.workers == {"w-0": "http://10.0.0.1:8000"}, 10, what="initial listing")
        wait_for(lambda: api.watches, 10, what="the watch to open")
        api.emit("MODIFIED", make_pod("w-1", "10.0.0.2"))
        api.emit("ADDED", make_pod("w-2", "10.0.0.3"))
        wait_for(lambda: registry.workers == {"w-0": "http://10.0.0.1:8000", "w-1": "http://10.0.0.2:8000",
                                              "w-2": "http://10.0.0.3:8000"}, 10, what="watch events")
        api.emit("DELETED", make_pod("w-0", "10.0.0.1"))
        wait_for(lambda: "w-0" not in registry.workers, 10, what="the deletion")
    finally:
        discovery.stop()
    assert not discovery._thread.is_alive()


def test_expired_watch_history_is_recovered_by_listing_again():
    api = FakePodApi()
    api.emit("ADDED", make_pod("w-0", "10.0.0.1"))
    api.emit("ADDED", make_pod("w-1", "10.0.0.2"))
    registry = RecordingRegistry()
    discovery = start(registry, SELECTOR, "llm", port=8000, core_api=api)
    try:
        wait_for(lambda: len(registry.workers) == 2 and api.watches, 10, what="the first watch")
        # w-1 goes away and w-2 appears, but the history is compacted before the watch sees
        # it: resuming the watch gets 410 Gone, and only a new listing can tell what changed.
        api.change_unseen("DELETED", make_pod("w-1", "10.0.0.2"))
        api.change_unseen("ADDED", make_pod("w-2", "10.0.0.3"))
        api.expire_history()
        wait_for(lambda: registry.workers == {"w-0": "http://10.0.0.1:8000", "w-2": "http://10.0.0.3:8000"},
                 10, what="re-listing after 410")
        assert api.lists >= 2
    finally:
        discovery.stop()


def test_registry_calls_run_on_the_routers_event_loop_and_coroutines_are_awaited():
    api = FakePodApi()
    api.emit("ADDED", make_pod("w-0", "10.0.0.1"))

    class AsyncRegistry(RecordingRegistry):
        async def add_worker(self, worker_id: str, url: str) -> None:  # type: ignore[override]
            await asyncio.sleep(0)
            super().add_worker(worker_id, url)

    async def scenario() -> tuple[set[int], int, dict]:
        registry = AsyncRegistry()
        discovery = start(registry, SELECTOR, "llm", port=8000, core_api=api)
        try:
            for _ in range(1000):
                if registry.workers:
                    break
                await asyncio.sleep(0.01)
        finally:
            discovery.stop()
        return registry.threads, threading.get_ident(), registry.workers

    threads, loop_thread, workers = asyncio.run(scenario())
    assert workers == {"w-0": "http://10.0.0.1:8000"}
    assert threads == {loop_thread}
