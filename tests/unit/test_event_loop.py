"""The servers' event loop: uvloop when installed (it is a dependency), asyncio when asked."""
from __future__ import annotations

import asyncio

import pytest

from prefixlb import aio


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_servers_run_on_uvloop_by_default(monkeypatch):
    monkeypatch.delenv(aio.ENV, raising=False)
    assert aio.loop_name() == "uvloop"
    assert aio.run(_loop_module()).startswith("uvloop")


def test_the_standard_loop_can_be_forced(monkeypatch):
    monkeypatch.setenv(aio.ENV, "asyncio")
    assert aio.loop_name() == "asyncio"
    assert aio.run(_loop_module()).startswith("asyncio")


def test_an_unknown_loop_name_is_refused(monkeypatch):
    monkeypatch.setenv(aio.ENV, "trio")
    with pytest.raises(ValueError, match="PREFIXLB_EVENT_LOOP"):
        aio.loop_name()
