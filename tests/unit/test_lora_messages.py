"""The LoRA fields of the worker-router messages: additive, so old and new peers still talk."""
from __future__ import annotations

import json

import pytest

from protocol import KVEvent, LoadReport, MessageError
from router.routing.load import LoadBoard, SpeedProfile

REPORT = LoadReport("w1", running=3, waiting=2, max_loras=2, lora_adapters={"sql": "0123456789abcdef", "chat": "fedcba9876543210"},
                    lora_gpu=["sql"], lora_cpu=["chat"], lora_running={"sql": 3}, lora_waiting={"chat": 2},
                    lora_disk_load_s=0.04, lora_slot_load_s=0.002, ts=100.0)


def test_a_load_report_with_adapters_round_trips_through_json():
    assert LoadReport.from_json(REPORT.to_json()) == REPORT


def test_a_report_from_a_worker_without_adapters_reads_as_no_adapters():
    old = {k: v for k, v in REPORT.to_dict().items() if not k.startswith(("lora_", "max_loras"))}
    report = LoadReport.from_dict(old)
    assert (report.max_loras, report.lora_adapters, report.lora_gpu, report.lora_waiting) == (0, {}, [], {})


def test_a_router_that_knows_no_adapter_fields_ignores_them_and_applies_the_load():
    # Fields a newer worker adds must not break an older reader: unknown keys are dropped.
    data = {**json.loads(REPORT.to_json()), "lora_something_newer": [1, 2]}
    board = LoadBoard(SpeedProfile(2000.0, 0.02, 2000, 4, 16))
    board.add_worker("w1")
    assert board.apply_report(LoadReport.from_dict(data), now=100.0)
    assert (board.get("w1").reported_running, board.get("w1").reported_in_system) == (3, 5)


def test_a_stored_kv_event_may_name_its_adapter_and_nothing_but_a_string_passes():
    event = KVEvent("w1", "stored", [1, 2], lora_name="sql")
    assert KVEvent.from_json(event.to_json()).lora_name == "sql"
    assert KVEvent.from_dict({"worker_id": "w1", "kind": "stored", "hashes": [1]}).lora_name is None
    with pytest.raises(MessageError, match="lora_name"):
        KVEvent.from_dict({"worker_id": "w1", "kind": "stored", "hashes": [1], "lora_name": 5})
