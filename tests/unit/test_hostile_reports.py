"""One hostile worker among N: whatever it reports, it cannot take the fleet (issue 13).

Every load report goes through ``LoadReport.from_dict`` (the schema: types, finiteness, physical
ranges) and the router's clamps (``router/routing/load.py``) before the policy sees it. A worker
that lies -- infinitely fast, never busy, a batch of a million -- still gets at most its fair
share plus the policy's spill allowance, and the honest workers' load is its own business only.
"""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import LoadReport, MessageError
from router.routing.balancer import Balancer
from router.routing.prompt import prompt_key

N = 4
HOSTILE = "w3"
NUMBERS = st.one_of(st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1e308, 2**63, 2**64, 1e9, 1e-9]),
                    st.text(max_size=3), st.none(), st.booleans(), st.lists(st.integers(), max_size=2))
FIELDS = ("running", "waiting", "queued_prefill_tokens", "running_tokens", "kv_usage", "free_blocks", "total_blocks",
          "block_size", "capacity_tokens", "max_num_seqs", "max_num_batched_tokens", "prefill_tokens_per_s",
          "decode_step_s", "ts")


def _decoded(raw: dict) -> LoadReport | None:
    try:
        return LoadReport.from_dict(raw)
    except MessageError:
        return None  # dropped and counted by the caller; never an exception out of the loop


def _run(hostile_reports: list[dict], seed: int) -> tuple[dict[str, int], dict[str, int]]:
    """Decisions per worker over a steady workload, and the honest workers' in-flight counts."""
    rng = random.Random(seed)
    balancer = Balancer()
    for i in range(N):
        balancer.add_worker(f"w{i}", block_size=16)
    prompts = [prompt_key({"model": "m", "prompt": f"group {g} " + "context " * 300 + str(k)}, False,
                          balancer.chunk_size, 8) for g in range(8) for k in range(4)]
    counts = {f"w{i}": 0 for i in range(N)}
    live: list[tuple[float, object]] = []
    now, report_at, reports = 1000.0, 1000.0, iter(hostile_reports * 50)
    for _ in range(600):
        now += 0.05
        done = [b for t, b in live if t <= now]
        live = [(t, b) for t, b in live if t > now]
        for booking in done:
            balancer.first_byte(booking, now)
            balancer.finish(booking, now, (2000, 0))
        if now >= report_at:
            report_at = now + 1.0
            for i in range(N - 1):
                mine = sum(1 for _, b in live if b.decision.worker_id == f"w{i}")
                balancer.apply_report(LoadReport(worker_id=f"w{i}", running=mine, block_size=16,
                                                 prefill_tokens_per_s=4000.0, decode_step_s=0.02, max_num_seqs=64,
                                                 ts=now), now)
            raw = next(reports, None)
            if raw is not None:
                report = _decoded({"worker_id": HOSTILE, **raw})
                if report is not None:
                    balancer.apply_report(report, now)
        prompt = rng.choice(prompts)
        decision = balancer.decide(prompt, now)
        counts[decision.worker_id] += 1
        live.append((now + 1.0, balancer.dispatch(decision, prompt, now)))
    honest = {f"w{i}": balancer.board.get(f"w{i}").in_system for i in range(N - 1)}
    return counts, honest


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.fixed_dictionaries({}, optional={f: NUMBERS for f in FIELDS}), min_size=1, max_size=4),
       st.integers(min_value=0, max_value=3))
def test_a_hostile_worker_gets_at_most_twice_its_fair_share_whatever_it_reports(reports, seed):
    counts, _ = _run(reports, seed)
    assert counts[HOSTILE] <= 2 * sum(counts.values()) / N, counts


@pytest.mark.parametrize("lie", [
    {"prefill_tokens_per_s": 1e9, "max_num_seqs": 1_000_000, "decode_step_s": 0.0, "running": 0, "waiting": 0},
    {"prefill_tokens_per_s": 1e9, "max_num_seqs": 1, "ts": 4e9},
    {"prefill_tokens_per_s": 1e-9, "kv_usage": 0.0, "ts": 0.0},
])
def test_the_lies_of_issue_13_do_not_take_the_fleet(lie):
    counts, honest = _run([lie], seed=1)
    assert counts[HOSTILE] <= 2 * sum(counts.values()) / N, counts
    assert all(v >= 0 for v in honest.values())


@pytest.mark.parametrize("field, value", [
    ("prefill_tokens_per_s", -1), ("prefill_tokens_per_s", math.inf), ("prefill_tokens_per_s", math.nan),
    ("running", "1"), ("running", -1), ("running", 2**63), ("max_num_seqs", 1e9), ("kv_usage", 1.5),
    ("worker_id", "a\r\nb"), ("worker_id", "x" * 1000), ("status", "owned"), ("ts", "x"), ("waiting", True),
])
def test_reports_outside_the_schema_are_refused(field, value):
    with pytest.raises(MessageError):
        LoadReport.from_dict({"worker_id": "w1", field: value})


def test_a_report_naming_another_worker_changes_nothing_of_the_other():
    balancer = Balancer()
    for w in ("w0", "w1"):
        balancer.add_worker(w, block_size=16)
    before = balancer.board.pending_s("w0", 10.0)
    from router.fleet.registry import WorkerRegistry

    registry = WorkerRegistry(balancer)
    victim = registry.add("http://10.0.0.1:8000", "flag")
    registry.mark_ok(victim, 10.0, report=LoadReport(worker_id="w0", ts=10.0))
    liar = registry.add("http://10.0.0.2:8000", "flag")
    registry.mark_ok(liar, 10.0, report=LoadReport(worker_id="w1", ts=10.0))
    # the liar, probed at its own URL, now names the victim: its report is filed under its own id
    registry.mark_ok(liar, 10.5, report=LoadReport(worker_id="w0", queued_prefill_tokens=10**9, waiting=10**6,
                                                   prefill_tokens_per_s=4.0, ts=10.5))
    assert balancer.board.pending_s("w0", 10.5) == pytest.approx(before, abs=1e-6)
    assert balancer.board.pending_s("w1", 10.5) > 1000


def test_a_poisoned_token_ratio_is_clamped_and_decisions_go_on():
    balancer = Balancer()
    balancer.add_worker("w0", block_size=16)
    prompt = prompt_key({"model": "m", "prompt": "hello " * 100}, False, balancer.chunk_size, 8)
    balancer.observe_prompt_tokens(prompt.ratio_key, prompt.num_bytes, 10**310)
    assert balancer.tokens_per_byte(prompt.ratio_key) == 4.0
    balancer.load_token_ratios({"m2": float("inf"), "m3": 1e308, "m4": -1.0, 5: 0.3})
    assert balancer.token_ratios().get("m3") == 4.0 and "m2" not in balancer.token_ratios()
    assert balancer.decide(prompt, 0.0).worker_id == "w0"


ANY = st.one_of(NUMBERS, st.text(max_size=300), st.lists(NUMBERS, max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                              NUMBERS, max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["load", "event", "info"]),
       st.dictionaries(st.sampled_from(["worker_id", "kind", "hashes", "chunk_size", "seq", "ts", "lora_name", "url",
                                        "model", "block_size", "capacity_tokens", "max_num_seqs", "status", "simulated",
                                        "started_at", *FIELDS, "lora_adapters", "lora_running", "lora_gpu"]),
                       ANY, max_size=8))
def test_any_message_decodes_to_a_sane_one_or_is_refused_with_a_message_error(which, raw):
    from protocol import KVEvent, WorkerInfo

    cls = {"load": LoadReport, "event": KVEvent, "info": WorkerInfo}[which]
    try:
        message = cls.from_dict(raw)
    except MessageError:
        return
    for name, value in message.to_dict().items():
        if isinstance(value, float):
            assert math.isfinite(value), name
        if isinstance(value, int) and not isinstance(value, bool):
            assert 0 <= value < 2**64 or name == "ts", (name, value)
        if isinstance(value, str):
            assert len(value) <= 2048 and "\n" not in value and "\r" not in value, name
    if which == "event":
        assert all(0 <= h < 2**64 for h in message.hashes)
