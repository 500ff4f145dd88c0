"""A cluster to break on purpose: simulated workers, routers, and a private Redis, as processes.

Used by ``test_chaos.py`` (and ``bench/``-style measurements): every process listens on
loopback at a free port and can be killed, stopped, restarted on the same port with the same
id. Redis is a ``redis-server`` of its own (never the shared one on 6379), so a test may stop it.

``LoadGenerator`` runs client traffic in a background thread (its own event loop, aiohttp):
``concurrency`` clients, round-robin over the routers, half of them streaming, prompts drawn
from a few shared documents plus a unique question, and records one :class:`Outcome` per
request -- what the client saw, byte for byte, classified.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.cluster import RedisServer
from tests.integration.worker_client import call
from tests.support import Proc, free_port, spawn, wait_for

MODEL = "sim"
ADMIN = {"Authorization": "Bearer s3cret"}


def document(i: int) -> str:
    """A shared 2 KB document (16 chunks of 128 bytes): the prefix many requests start with."""
    text = "".join(f"Document {i}, clause {j}: the supplier delivers within {j + 7} days. " for j in range(40))
    return text[:2048]


@dataclass
class Cluster:
    """Workers and routers around one private Redis (see the module docstring)."""

    logs: Path
    redis: RedisServer
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    workers: dict[str, Proc] = field(default_factory=dict)
    routers: list[Proc] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    _restarts: int = 0

    def start_worker(self, worker_id: str, wait: bool = True) -> Proc:
        """Start (or restart, on its old port) the simulated worker ``worker_id``."""
        port = self.ports.setdefault(worker_id, free_port())
        self._restarts += 1
        proc = spawn(["worker", "--simulate", "--served-model-name", MODEL, "--port", str(port),
                      "--worker-id", worker_id, "--redis", self.redis.url, "--advertise", f"http://127.0.0.1:{port}",
                      *self.worker_args], self.logs, f"{worker_id}-{self._restarts}", port,
                     ready_path="/health" if wait else None)
        self.workers[worker_id] = proc
        return proc

    def start_router(self, index: int | None = None) -> Proc:
        """Start a router (``index``: restart that one, on its old port)."""
        name = f"router{len(self.routers) if index is None else index}"
        port = self.ports.setdefault(name, free_port())
        self._restarts += 1
        proc = spawn(["router", "--port", str(port), "--redis", self.redis.url, *self.router_args],
                     self.logs, f"{name}-{self._restarts}", port)
        if index is None:
            self.routers.append(proc)
        else:
            self.routers[index] = proc
        return proc

    def routable(self, router: Proc) -> set[str]:
        """Worker ids the router routes to now."""
        reply = call(router.url + "/admin/workers", headers=ADMIN, timeout=5)
        return {w["worker_id"] for w in reply.json["workers"] if w["state"] in ("healthy", "recovering")}

    def states(self, router: Proc) -> dict[str, str]:
        reply = call(router.url + "/admin/workers", headers=ADMIN, timeout=5)
        return {w["worker_id"]: w["state"] for w in reply.json["workers"]}

    def wait_routable(self, ids: set[str], timeout: float = 60.0) -> None:
        """Until every router routes to exactly ``ids``, all healthy (breakers closed)."""
        def ok() -> bool:
            return all({k for k, v in self.states(r).items() if v == "healthy"} == ids
                       and set(self.states(r)) >= ids for r in self.routers)
        wait_for(ok, timeout, interval=0.1, what=f"every router to route to {sorted(ids)}")

    def stop(self) -> None:
        for p in [*self.routers, *self.workers.values()]:
            p.signal(signal.SIGCONT)
            p.stop()
        self.redis.stop()


def metric(router: Proc, name: str) -> float:
    """The sum of a router metric's samples whose line starts with ``name``."""
    total = 0.0
    for line in call(router.url + "/metrics", timeout=5).raw.decode().splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Outcome:
    """What one client request saw."""

    started: float
    ended: float
    router: int
    stream: bool
    status: int = 0
    worker: str = ""
    first_byte: bool = False  # streaming: at least one event arrived
    done: bool = False  # streaming: ended with data: [DONE]
    error_event: bool = False  # streaming: an in-stream {"error": ...} event
    cached_tokens: int | None = None
    error: str = ""  # a client-side failure (connection refused, reset, timeout)

    @property
    def ok(self) -> bool:
        """A complete, successful answer."""
        if self.error or self.status != 200:
            return False
        return (self.done and not self.error_event) if self.stream else True

    @property
    def clean_failure(self) -> bool:
        """A failure the client was told about properly: an error event then [DONE]."""
        return self.stream and self.status == 200 and self.first_byte and self.error_event and self.done


class LoadGenerator:
    """Client traffic in a background thread (see the module docstring)."""

    def __init__(self, routers: list[str], concurrency: int = 8, documents: int = 8, stream_tokens: int = 48,
                 whole_tokens: int = 8, seed: int = 0, timeout: float = 60.0, new_prefix_share: float = 0.0) -> None:
        self.routers = routers
        self.new_prefix_share = new_prefix_share  # requests whose document nobody has seen before
        self.concurrency = concurrency
        self.documents = documents
        self.stream_tokens = stream_tokens
        self.whole_tokens = whole_tokens
        self.timeout = timeout
        self.outcomes: list[Outcome] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counter = 0

    def __enter__(self) -> "LoadGenerator":
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout + 30)
            assert not self._thread.is_alive(), "the load generator did not stop"
            self._thread = None

    def since(self, t: float) -> list[Outcome]:
        return [o for o in list(self.outcomes) if o.started >= t]

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.concurrency)))

    async def _client(self, http: aiohttp.ClientSession, index: int) -> None:
        while not self._stop.is_set():
            self._counter += 1
            n = self._counter
            stream = n % 2 == 0
            router = n % len(self.routers)
            doc = self._rng.randrange(self.documents)
            if self._rng.random() < self.new_prefix_share:
                doc = 1_000_000 + n
            body = {"model": MODEL, "prompt": document(doc) + f" Question {n}: what is due on day {n % 97}?",
                    "max_tokens": self.stream_tokens if stream else self.whole_tokens, "ignore_eos": True,
                    "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            outcome = Outcome(time.time(), 0.0, router, stream)
            try:
                await self._one(http, self.routers[router], body, outcome)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                outcome.error = f"{type(exc).__name__}: {exc}"
            outcome.ended = time.time()
            self.outcomes.append(outcome)
            if outcome.error:
                await asyncio.sleep(0.05)  # a refused connection returns at once: do not spin

    @staticmethod
    async def _one(http: aiohttp.ClientSession, url: str, body: dict, outcome: Outcome) -> None:
        async with http.post(url + "/v1/completions", json=body) as resp:
            outcome.status = resp.status
            outcome.worker = resp.headers.get("X-Prefixlb-Worker", "")
            if not body["stream"]:
                data = await resp.json(content_type=None)
                usage = data.get("usage") if isinstance(data, dict) else None
                if usage:
                    outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                return
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        outcome.done = True
                        continue
                    outcome.first_byte = True
                    data = json.loads(payload)
                    if "error" in data:
                        outcome.error_event = True
                    elif data.get("usage"):
                        outcome.cached_tokens = data["usage"]["prompt_tokens_details"]["cached_tokens"]


@contextlib.contextmanager
def chaos_cluster(logs: Path, workers: int = 4, routers: int = 2, worker_args: list[str] | None = None,
                  router_args: list[str] | None = None):
    """Start Redis, ``workers`` workers (w0, w1, ...) and ``routers`` routers; stop them all on exit."""
    cluster = Cluster(logs, RedisServer(logs / "redis"), worker_args or [], router_args or [])
    try:
        cluster.redis.start()
        for i in range(workers):
            cluster.start_worker(f"w{i}", wait=False)  # they start in parallel
        for proc in cluster.workers.values():
            wait_for(lambda: not proc.alive() or call(proc.url + "/health", timeout=2).status == 200, 60,
                     what=f"{proc.url} healthy")
            assert proc.alive(), proc.output()[-3000:]
        for _ in range(routers):
            cluster.start_router()
        cluster.wait_routable({f"w{i}" for i in range(workers)})
        yield cluster
    finally:
        cluster.stop()
