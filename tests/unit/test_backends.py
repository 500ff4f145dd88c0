"""Worker specs: ``[KIND=]URL[,kv-events=ENDPOINT][,kv-replay=ENDPOINT]`` (router/fleet/backends.py)."""
from __future__ import annotations

import pytest

from router.fleet.backends import InvalidWorkerSpec, WorkerSpec, check_zmq_endpoint, parse_worker_spec
from router.fleet.registry import InvalidWorkerURL, WorkerRegistry
from router.fleet.worker_url import WorkerURLPolicy
from router.routing.balancer import Balancer


@pytest.mark.parametrize("text, spec", [
    ("http://10.0.0.5:8000", WorkerSpec(url="http://10.0.0.5:8000")),
    ("vllm=http://10.0.0.5:8000", WorkerSpec(url="http://10.0.0.5:8000", kind="vllm")),
    ("SGLang=http://h:30000", WorkerSpec(url="http://h:30000", kind="sglang")),
    ("vllm=http://h:8000,kv-events=tcp://h:5557,kv-replay=tcp://h:5558",
     WorkerSpec(url="http://h:8000", kind="vllm", kv_events="tcp://h:5557", kv_replay="tcp://h:5558")),
    ("http://h:8000, kv-events=tcp://10.1.2.3:5557", WorkerSpec(url="http://h:8000", kv_events="tcp://10.1.2.3:5557")),
])
def test_worker_specs_name_the_url_the_kind_and_the_kv_event_sockets(text, spec):
    assert parse_worker_spec(text) == spec
    assert parse_worker_spec(str(spec)) == spec


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("triton=http://h:8000", "unknown worker kind"),
    ("vllm=http://h:8000,kv=tcp://h:1", "unknown worker option"),
    ("vllm=http://h:8000,kv-events=http://h:1", "tcp://HOST:PORT"),
    ("vllm=http://h:8000,kv-events=tcp://*:5557", "tcp://HOST:PORT"),
    ("vllm=http://h:8000,kv-events=tcp://h", "tcp://HOST:PORT"),
    ("vllm=http://h:8000,kv-events=tcp://h:99999", "tcp://HOST:PORT"),
    ("vllm=http://h:8000,kv-replay=tcp://h:5558", "kv-replay needs kv-events"),
    ("prefixlb=http://h:8000,kv-events=tcp://h:5557", "vllm or sglang"),
    ("vllm=http://h:8000,kv-events=tcp://h:1,kv-events=tcp://h:2", "given twice"),
])
def test_bad_worker_specs_are_refused_with_the_reason(text, message):
    with pytest.raises(InvalidWorkerSpec, match=message):
        parse_worker_spec(text)


def test_zmq_endpoints_are_host_and_port():
    assert check_zmq_endpoint("tcp://127.0.0.1:5557") == ("127.0.0.1", 5557)
    assert check_zmq_endpoint("tcp://[::1]:5557") == ("::1", 5557)


def test_a_kv_event_host_outside_the_worker_allow_list_is_refused():
    registry = WorkerRegistry(Balancer(), url_policy=WorkerURLPolicy(["10.0.0.0/8:8000"]))
    ok = parse_worker_spec("vllm=http://10.0.0.5:8000,kv-events=tcp://10.0.0.5:5557")
    w = registry.add(ok.url, "flag", spec=ok)
    assert (w.kind, w.kv_events, w.backend_kind) == ("vllm", "tcp://10.0.0.5:5557", "vllm")
    bad = parse_worker_spec("vllm=http://10.0.0.6:8000,kv-events=tcp://192.168.1.1:5557")
    with pytest.raises(InvalidWorkerURL, match="KV-event host"):
        registry.add(bad.url, "flag", spec=bad)
    assert registry.get("http://10.0.0.6:8000") is None
