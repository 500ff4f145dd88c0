"""Adapters at the router's edges: a vLLM backend's lora_requests_info as a LoadReport, the adapters
a worker reports as models the registry accepts, and the per-adapter metrics."""
from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from protocol import LoadReport
from router.fleet.engine_metrics import load_report, parse_engine_metrics
from router.fleet.registry import WorkerRegistry
from router.lora_metrics import adapter_metrics
from router.routing.balancer import Balancer
from router.routing.prompt import prompt_key

DATA = Path(__file__).resolve().parent.parent / "data"


def test_a_vllm_backends_running_adapters_are_in_its_slots_and_its_waiting_ones_queue_for_one():
    text = (DATA / "vllm_metrics_idle.txt").read_text() + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.8e9\n')
    report = load_report("v1", parse_engine_metrics(text, ts=0.0))
    assert (report.max_loras, report.lora_gpu, report.lora_running, report.lora_waiting) == (
        2, ["sql", "chat"], {"sql": 1, "chat": 1}, {"math": 1})
    assert report.lora_adapters == {} and report.lora_cpu == []
    b = Balancer()
    b.add_worker("v1")
    b.apply_report(report, now=0.0)
    # Both slots pinned and math already waiting: a new adapter waits for two slot turnovers.
    service = b.board.get("v1").service_s
    assert b.adapters.ready_s("v1", "sql", service) == 0.0
    assert b.adapters.get("v1").ready_s("new", service)[1] == 2 * service / 2
    assert b.adapters.get("v1").serves("anything")  # vLLM lists no adapters: it may load any


def test_a_vllm_backend_without_lora_reports_no_adapters():
    report = load_report("v1", parse_engine_metrics((DATA / "vllm_metrics_idle.txt").read_text(), ts=0.0))
    assert (report.max_loras, report.lora_gpu, report.lora_running) == (0, [], {})


def test_adapters_a_worker_reports_are_models_for_it_alone_and_follow_its_reports():
    reg = WorkerRegistry(Balancer(), unhealthy_after=2)
    a, b = reg.add("http://127.0.0.1:9001", "flag"), reg.add("http://127.0.0.1:9002", "flag")
    reg.mark_ok(a, now=1.0, report=LoadReport("wa", lora_adapters={"sql": "01" * 8}), models=("tiny",))
    reg.mark_ok(b, now=1.0, report=LoadReport("wb"), models=("tiny",))
    assert reg.models() == ["sql", "tiny"]
    assert reg.excluded_for("sql") == {"wb"} and reg.excluded_for("tiny") == set()
    reg.mark_ok(a, now=2.0, report=LoadReport("wa", lora_adapters={"x" * 300: "1", "chat": "2"}))
    assert reg.models() == ["chat", "tiny"]  # sql unloaded; an over-long name is not a model


def test_per_adapter_metrics_count_requests_loads_by_tier_and_where_adapters_are_only_for_reported_names():
    b = Balancer()
    for w in ("w1", "w2"):
        b.add_worker(w)
    b.apply_report(LoadReport("w1", max_loras=2, lora_adapters={"sql": "1"}, lora_cpu=["sql"]), now=0.0)
    b.apply_report(LoadReport("w2", max_loras=2, lora_adapters={"sql": "1"}), now=0.0)
    for adapter in ("sql", "sql", "made-up"):
        p = prompt_key({"model": "base", "prompt": "hello", "lora_adapter": adapter}, chat=False, chunk_size=128,
                       ring_key_chunks=8)
        b.dispatch(b.decide(p, now=0.0), p, now=0.0)

    class Reader(Collector):
        def collect(self):
            return adapter_metrics(b.adapters)

    registry = CollectorRegistry()
    registry.register(Reader())
    text = generate_latest(registry).decode()
    assert 'prefixlb_router_lora_requests_total{adapter="sql"} 2.0' in text
    first_tier = "cpu" if b.adapters.get("w1").sent else "disk"
    assert f'prefixlb_router_lora_loads_total{{adapter="sql",tier="{first_tier}"}} 1.0' in text
    assert 'prefixlb_router_lora_adapter_workers{adapter="sql",tier="gpu"} 1.0' in text
    assert "made-up" not in text  # a client's string is not a label (it went to its home, which will say 4xx)
