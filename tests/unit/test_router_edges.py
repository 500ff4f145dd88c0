"""The router's small pure pieces at its edges: SSE usage tap, snapshots, config, request helpers."""
from __future__ import annotations

import asyncio
import json

import pytest

from protocol.openai_api import OpenAIError
from protocol.settings import SettingsError
from router.http.admin import check_token
from router.http.api import parse_affinity, with_include_usage
from router.config import load_router_config
from router.snapshot import SnapshotError, decode, encode
from router.http.sse import UsageTap, usage_numbers

USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
         "prompt_tokens_details": {"cached_tokens": 32}}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_the_usage_only_chunk_is_dropped_when_the_client_did_not_ask_for_usage():
    tap = UsageTap(strip=True)
    chunk = sse({"choices": [{"delta": {"content": "hi"}}], "usage": None})
    usage_chunk = sse({"choices": [], "usage": USAGE})
    out = tap.feed(chunk + usage_chunk + b"data: [DONE]\n\n")
    assert out == chunk + b"data: [DONE]\n\n"
    assert tap.usage == USAGE


def test_usage_is_kept_when_the_client_asked_for_it():
    tap = UsageTap(strip=False)
    usage_chunk = sse({"choices": [], "usage": USAGE})
    assert tap.feed(usage_chunk) == usage_chunk
    assert usage_numbers(tap.usage) == (40, 32)


def test_usage_riding_on_a_content_chunk_is_removed_but_the_content_kept():
    tap = UsageTap(strip=True)
    out = tap.feed(sse({"choices": [{"delta": {"content": "x"}}], "usage": USAGE}))
    assert json.loads(out[len(b"data: "):]) == {"choices": [{"delta": {"content": "x"}}]}
    assert tap.usage == USAGE


def test_events_split_across_reads_are_forwarded_once_complete():
    tap = UsageTap(strip=True)
    event = sse({"choices": [{"delta": {"content": "abc"}}]})
    assert tap.feed(event[:10]) == b""
    assert tap.feed(event[10:] + event[:5]) == event
    assert tap.feed(event[5:]) == event
    assert tap.flush() == b""


def test_usage_numbers_need_prompt_tokens_and_report_missing_cached_tokens_as_unknown():
    assert usage_numbers(USAGE) == (40, 32)
    assert usage_numbers({"prompt_tokens": 40}) == (40, None)
    assert usage_numbers({"completion_tokens": 1}) is None
    assert usage_numbers(None) is None


def test_a_snapshot_round_trips_entries_stream_id_and_ratios():
    entries = [(1, "w1", 10.0), (2**64 - 1, "w1", 5.5), (3, "w2", 1.25)]
    data = encode(entries, "1700000000000-3", 123.0, 128, {"tiny": 1.5})
    snap = decode(data)
    assert (snap.stream_id, snap.taken_at, snap.chunk_size, snap.ratios) == ("1700000000000-3", 123.0, 128,
                                                                             {"tiny": 1.5})
    assert snap.entries == entries


@pytest.mark.parametrize("data", [b"no header", b'{"v": 2}\n', b'{"v": 1, "stream_id": "0"}\n',
                                  encode([(1, "w", 1.0)], "0", 0.0, 128, {})[:-3]])
def test_a_foreign_or_truncated_snapshot_is_refused(data):
    with pytest.raises(SnapshotError):
        decode(data)


def test_config_layers_defaults_yaml_env_and_flags(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("affinity: 0.3\npolicy: least_load\nport: 9000\n")
    cfg = load_router_config(["--config", str(path), "--port", "9100", "--worker", "http://a:1",
                              "--worker", "http://b:2"],
                             environ={"PREFIXLB_ROUTER_POLICY": "round_robin",
                                      "PREFIXLB_ROUTER_ADMIN_TOKEN": "s3cret"})
    assert (cfg.affinity, cfg.policy, cfg.port, cfg.admin_token) == (0.3, "round_robin", 9100, "s3cret")
    assert cfg.workers == ["http://a:1", "http://b:2"]
    assert cfg.policy_config().affinity == 0.3


@pytest.mark.parametrize("argv", [["--affinity", "1.5"], ["--policy", "random"], ["--chunk-size", "0"]])
def test_invalid_settings_are_refused(argv):
    with pytest.raises((SettingsError, SystemExit)):
        load_router_config(argv, environ={})


@pytest.mark.parametrize("value,expected", [(None, None), ("0", 0.0), ("0.25", 0.25), ("1", 1.0)])
def test_the_affinity_header_accepts_numbers_in_zero_one(value, expected):
    assert parse_affinity(value) == expected


@pytest.mark.parametrize("value", ["-0.1", "1.01", "nan", "inf", "high", ""])
def test_the_affinity_header_refuses_anything_else_with_a_400(value):
    with pytest.raises(OpenAIError) as exc:
        parse_affinity(value)
    assert exc.value.status == 400 and exc.value.param == "X-Prefixlb-Affinity"


def test_streaming_bodies_are_patched_to_ask_the_worker_for_usage():
    raw = b'{"model": "m", "prompt": "hi", "stream": true}\n'
    patched = json.loads(with_include_usage(raw, json.loads(raw)))
    assert patched == {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    raw = b'{"model": "m", "prompt": "hi", "stream": true, "stream_options": {"include_usage": false}}'
    assert json.loads(with_include_usage(raw, json.loads(raw)))["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("header,token,status", [
    (None, None, 403), ("Bearer x", None, 403), (None, "s3cret", 401), ("Bearer wrong", "s3cret", 403),
    ("Basic s3cret", "s3cret", 403), ("Bearer s3cret-and-more", "s3cret", 403)])
def test_admin_calls_without_the_right_bearer_token_are_refused(header, token, status):
    with pytest.raises(OpenAIError) as exc:
        check_token(header, token)
    assert exc.value.status == status


def test_the_right_bearer_token_passes():
    check_token("Bearer s3cret", "s3cret")
    check_token("bearer s3cret", "s3cret")


async def test_the_proxy_forgets_the_guards_of_workers_that_left():
    # Kubernetes replaces pods under new names: per-worker state must not pile up forever.
    from router.routing.balancer import Balancer
    from router.metrics import RouterMetrics
    from router.http.proxy import Proxy
    from router.fleet.connections import WorkerConnections
    from router.fleet.registry import WorkerRegistry

    registry = WorkerRegistry(Balancer())
    proxy = Proxy(Balancer(), registry, RouterMetrics(), WorkerConnections(1.0, 1.0), 1)
    for i in range(50):
        registry.add(f"http://127.0.0.1:{9000 + i}", "admin", f"pod-{i}")
        proxy._guard(f"pod-{i}", asyncio.get_running_loop())
        registry.remove(f"pod-{i}")
    assert proxy._guards == {}


def _guarded_proxy():
    from router.routing.balancer import Balancer
    from router.metrics import RouterMetrics
    from router.http.proxy import Proxy
    from router.fleet.connections import WorkerConnections
    from router.fleet.registry import WorkerRegistry

    return Proxy(Balancer(), WorkerRegistry(Balancer()), RouterMetrics(), WorkerConnections(1.0, 1.0), 1)


async def test_an_aborted_worker_ends_its_guarded_attempts_with_a_timeout_error():
    import asyncio

    proxy = _guarded_proxy()
    guard = proxy._guard("w1", asyncio.get_running_loop())
    entered = asyncio.Event()

    async def attempt() -> None:
        async with guard:
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.ensure_future(attempt())
    await entered.wait()
    assert proxy.abort_worker("w1") == 1 and not guard.expired()  # cancelled in the next turn
    with pytest.raises(TimeoutError):
        await task
    assert guard.expired() and proxy.abort_worker("w1") == 0 and task.cancelling() == 0


async def test_a_client_disconnect_during_an_abort_stays_a_cancellation():
    # the request's own cancellation (its client went away) must not turn into a retryable timeout
    import asyncio

    proxy = _guarded_proxy()
    entered = asyncio.Event()

    async def attempt() -> None:
        async with proxy._guard("w1", asyncio.get_running_loop()):
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.ensure_future(attempt())
    await entered.wait()
    proxy.abort_worker("w1")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_guard_left_before_its_abort_lands_is_not_cancelled():
    import asyncio

    proxy = _guarded_proxy()
    guard = proxy._guard("w1", asyncio.get_running_loop())
    async with guard:
        assert proxy.abort_worker("w1") == 1
    await asyncio.sleep(0.01)  # the turn in which the abort would have landed
    assert not guard.expired() and asyncio.current_task().cancelling() == 0
