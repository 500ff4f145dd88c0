"""``prefixlb router`` and ``prefixlb worker`` (one ``ServerCommand``): exit statuses and messages.

2 for settings that cannot start (named after the command), 1 when the server cannot start (the
port is taken); real processes, as an operator or a supervisor runs them.
"""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support import ROOT


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixlb", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args,message", [
    (["router", "--port", "70000"], "prefixlb router: "),
    (["router", "--worker", "gopher://10.0.0.5:70"], "prefixlb router: not an http(s) worker URL"),
    (["router", "--admin-token", "change-me"], "prefixlb router: --admin-token: 'change-me' is a placeholder"),
    (["router", "--port", "8000", "--admin-port", "8000"], "prefixlb router: --admin-port 8000 is --port"),
    (["router", "--worker", "http://169.254.169.254"], "prefixlb router: worker URL 'http://169.254.169.254' is a "
                                                        "link-local or cloud-metadata address"),
    (["worker", "--port", "70000"], "prefixlb worker: "),
    (["worker", "--simulate", "--kv-memory", "12XB"], "prefixlb worker: invalid size '12XB'"),
])
def test_settings_that_cannot_start_exit_2_with_the_command_named(args, message):
    result = _run(*args)
    assert (result.returncode, result.stderr.startswith(message)) == (2, True), result.stderr[-2000:]


@pytest.mark.parametrize("command", [["router"], ["worker", "--simulate"]])
def test_a_port_already_taken_exits_1_saying_it_cannot_start(command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = _run(*command, "--port", str(taken.getsockname()[1]), "--log-level", "warning")
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"prefixlb {command[0]}: cannot start: " in result.stderr
