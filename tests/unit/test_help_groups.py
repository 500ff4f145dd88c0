"""``--help`` of the router and the worker lists the flags by topic (argparse argument groups)."""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import pytest

from prefixlb.commands import router as router_command
from prefixlb.commands import worker as worker_command
from protocol.settings import build_parser, setting


def _help(command) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        command.main(["--help"])
    return out.getvalue()


def _section(text: str, title: str) -> str:
    start = text.index(f"\n{title}:\n")
    end = text.find("\n\n", start + 2)
    return text[start:end]


@pytest.mark.parametrize("command, title, flags", [
    (worker_command, "model", ["--model", "--tokenizer", "--chat-template", "--tool-call-parser", "--dtype"]),
    (worker_command, "KV cache and batching", ["--kv-memory", "--gpu-memory-utilization", "--max-num-seqs"]),
    (worker_command, "Redis and KV events", ["--redis", "--redis-signing-key", "--heartbeat-interval"]),
    (worker_command, "simulated GPU (--simulate)", ["--simulate", "--gpu", "--time-scale"]),
    (router_command, "routing policy", ["--policy", "--affinity", "--session-header"]),
    (router_command, "limits and admission", ["--max-body-bytes", "--max-queue"]),
    (router_command, "listening, access and logs", ["--port", "--admin-token", "--log-format"]),
])
def test_help_lists_each_flag_under_its_topic(command, title, flags):
    section = _section(_help(command), title)
    for flag in flags:
        assert f"  {flag} " in section or f"  {flag}," in section, f"{flag} not under {title!r}"


def test_every_setting_of_the_router_and_the_worker_has_a_topic():
    for command in (router_command, worker_command):
        assert "other options:" not in _help(command)


def test_a_setting_outside_every_group_is_listed_under_other_options_and_an_unknown_name_is_refused():
    @dataclass
    class Settings:
        port: int = setting(1, "port")
        colour: str = setting("red", "colour")

    text = build_parser(Settings, groups={"network": ("port",)}, prog="x").format_help()
    assert "  --colour COLOUR" in _section(text, "other options")
    with pytest.raises(ValueError, match="help group 'network' names no setting of Settings: \\['prot'\\]"):
        build_parser(Settings, groups={"network": ("prot",)})
