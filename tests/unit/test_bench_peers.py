"""Peer routers are started bound to loopback only (router and metrics), offline."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.peers.launch import PeerError, peer_command, peer_env


def _fake_venv(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    for name in ("python", "vllm-router"):
        (tmp_path / "bin" / name).write_text("")
    return tmp_path


@pytest.mark.parametrize("peer,policy", [("sglang-router", "cache_aware"), ("vllm-router", "cache_aware"),
                                         ("vllm-router", "consistent_hash")])
def test_peer_listens_and_exports_metrics_on_loopback_only(tmp_path, peer, policy):
    cmd = peer_command(peer, 30000, policy, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"], 29000,
                       _fake_venv(tmp_path))
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--policy") + 1] == policy
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == [
        "http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert "0.0.0.0" not in cmd


def test_peer_environment_forbids_downloads():
    env = peer_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_unknown_peers_policies_and_missing_installs_are_clear_errors(tmp_path):
    with pytest.raises(PeerError, match="unknown peer"):
        peer_command("nginx", 1, "cache_aware", ["http://127.0.0.1:1"], 2, tmp_path)
    with pytest.raises(PeerError, match="has no policy"):
        peer_command("sglang-router", 1, "consistent_hash", ["http://127.0.0.1:1"], 2, tmp_path)
    with pytest.raises(PeerError, match="install.sh"):
        peer_command("vllm-router", 1, "cache_aware", ["http://127.0.0.1:1"], 2, tmp_path / "none")
