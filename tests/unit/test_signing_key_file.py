"""A worker's signing key handed to it as a file (``--redis-signing-key-file``), written by
``prefixlb signing-key --out`` (what the chart's init container and compose's signing-keys run)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from protocol.settings import SettingsError
from protocol.signing import worker_key
from tests.deploy_support import load_server_config
from tests.support import ROOT
from worker.server.config import signing_key

SECRET = "fleet-secret-for-tests"


def _prefixlb(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixlb", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": os.environ["PATH"], **(env or {})})


def test_signing_key_out_writes_the_workers_key_readable_by_its_owner_only(tmp_path):
    out = tmp_path / "key"
    for _ in range(2):  # a second run (a restarted pod, the next `compose up`) replaces it
        proc = _prefixlb("signing-key", "--worker-id", "w-0", "--out", str(out),
                         env={"PREFIXLB_REDIS_SIGNING_SECRET": SECRET})
        assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert out.read_text() == worker_key(SECRET, "w-0") + "\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]  # no temporary file left
    assert _prefixlb("signing-key", "--worker-id", "w-0", "--out", str(out)).returncode == 2  # no secret
    proc = _prefixlb("signing-key", "--worker-id", "w-0", "--out", str(tmp_path / "missing" / "key"),
                     env={"PREFIXLB_REDIS_SIGNING_SECRET": SECRET})
    assert proc.returncode == 1 and "cannot write" in proc.stderr


def test_the_worker_reads_its_key_from_the_file_when_it_starts(tmp_path):
    key_file = tmp_path / "key"
    cfg = load_server_config(["--redis-signing-key-file", str(key_file)])  # not read at load: written later
    with pytest.raises(SettingsError, match="cannot read it"):
        signing_key(cfg)
    key_file.write_text(worker_key(SECRET, "w-0") + "\n")
    assert signing_key(cfg) == worker_key(SECRET, "w-0")
    key_file.write_text("not-a-key\n")
    with pytest.raises(SettingsError, match="64 hex digits"):
        signing_key(cfg)
    assert signing_key(load_server_config(["--redis-signing-key", worker_key(SECRET, "w-0")])) == \
        worker_key(SECRET, "w-0")


@pytest.mark.parametrize("argv,message", [
    (["--redis-signing-key", "00" * 32, "--redis-signing-key-file", "/k"], "not both"),
    (["--redis-signing-key", "secret-in-a-flag"], "64 hex digits"),
])
def test_a_key_and_a_key_file_or_a_malformed_key_are_refused(argv, message):
    with pytest.raises(SettingsError, match=message):
        load_server_config(argv)


def test_a_worker_whose_key_file_is_missing_stops_before_it_loads_anything(tmp_path):
    proc = _prefixlb("worker", "--simulate", "--port", "1", "--redis", "redis://127.0.0.1:1/0",
                     "--redis-signing-key-file", str(tmp_path / "absent"))
    assert proc.returncode == 2, proc.stderr
    assert "--redis-signing-key-file: cannot read it" in proc.stderr
