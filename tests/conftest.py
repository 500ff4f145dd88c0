"""Fixtures shared by the whole suite: a real Redis (with an isolated key prefix per test)."""
from __future__ import annotations

import contextlib

import os
import socket
import uuid

import pytest

REDIS_HOST = os.environ.get("PREFIXLB_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("PREFIXLB_TEST_REDIS_PORT", "6379"))


def _redis_answers() -> bool:
    try:
        with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_server_url() -> str:
    """URL of the real Redis `make test` guarantees (scripts/ensure-redis.sh)."""
    if not _redis_answers():
        pytest.fail(f"Redis does not answer on {REDIS_HOST}:{REDIS_PORT}: run `make redis`")
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/0"


@contextlib.contextmanager
def _unique_redis_prefix(redis_server_url: str):
    import redis

    prefix = f"prefixlb-test-{uuid.uuid4().hex[:10]}:"
    yield prefix
    client = redis.Redis.from_url(redis_server_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def redis_prefix(redis_server_url: str):
    """A key prefix unique to this test; its keys are deleted afterwards."""
    with _unique_redis_prefix(redis_server_url) as prefix:
        yield prefix


@pytest.fixture(scope="module")
def module_redis_prefix(redis_server_url: str):
    """A key prefix unique to this test module (a cluster its tests share); deleted afterwards."""
    with _unique_redis_prefix(redis_server_url) as prefix:
        yield prefix


# ---- real vLLM servers (tests/vllm_support.py) ------------------------------------------------
_vllm_background = None


def pytest_collection_finish(session):
    """Start the vLLM fleet in the background as soon as a collected test needs it."""
    global _vllm_background
    from tests import vllm_support

    wanted = any("vllm_fleet" in getattr(item, "fixturenames", ()) for item in session.items)
    if wanted and vllm_support.vllm_missing_reason() is None and not session.config.option.collectonly:
        _vllm_background = vllm_support.BackgroundFleet()


def pytest_sessionfinish(session, exitstatus):
    if _vllm_background is not None:
        _vllm_background.stop()


@pytest.fixture(scope="session")
def vllm_fleet():
    """Two real vLLM servers on the tiny checkpoint (started once per run, stopped at its end)."""
    from tests import vllm_support

    reason = vllm_support.vllm_missing_reason()
    if reason is not None:
        if vllm_support.vllm_required():
            pytest.fail(f"PREFIXLB_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)
    assert _vllm_background is not None, "the vLLM fleet was not started at collection"
    return _vllm_background.get()
