"""Start a peer router (sglang-router or vllm-router, from ``.venv-peers``) in front of given workers.

Both are bound to 127.0.0.1 only, and so are their Prometheus listeners; neither may download
anything (the simulated workers' server info names no ``model_path``, so sglang-router does not
try to fetch a tokenizer). Install them first with ``bench/peers/install.sh``.

    python -m bench.peers.launch sglang-router --port 30000 --policy cache_aware http://127.0.0.1:8001 ...
    python -m bench.peers.launch vllm-router --port 30001 --policy consistent_hash http://127.0.0.1:8001 ...
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from bench.process_group import stop_group

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".venv-peers"
PEERS = ("sglang-router", "vllm-router")
POLICIES = {
    "sglang-router": ("cache_aware", "round_robin", "power_of_two", "random"),
    "vllm-router": ("cache_aware", "consistent_hash", "round_robin", "power_of_two", "random"),
}


class PeerError(RuntimeError):
    """A peer is not installed, or asked for a policy it does not have."""


def peer_command(name: str, port: int, policy: str, workers: Sequence[str], prometheus_port: int,
                 venv: Path = DEFAULT_VENV) -> list[str]:
    """The command line that starts peer ``name`` on 127.0.0.1:``port`` in front of ``workers``."""
    if name not in PEERS:
        raise PeerError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")
    if policy not in POLICIES[name]:
        raise PeerError(f"{name} has no policy {policy!r} (has: {', '.join(POLICIES[name])})")
    if not workers:
        raise PeerError("a peer router needs at least one worker URL")
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", policy,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
              "--worker-urls", *workers]
    if name == "sglang-router":
        exe = venv / "bin" / "python"
        if not exe.exists():
            raise PeerError(f"{exe} not found: run bench/peers/install.sh")
        return [str(exe), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    exe = venv / "bin" / "vllm-router"
    if not exe.exists():
        raise PeerError(f"{exe} not found: run bench/peers/install.sh")
    return [str(exe), *common, "--log-level", "warning"]


def peer_env() -> dict[str, str]:
    """Environment for a peer: offline (no Hugging Face downloads), quiet."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost", "RUST_LOG": env.get("RUST_LOG", "warn")})
    return env


def start_peer(name: str, port: int, policy: str, workers: Sequence[str], prometheus_port: int,
               log_path: Path, venv: Path = DEFAULT_VENV) -> subprocess.Popen:
    """Start the peer in its own process group; its output goes to ``log_path``."""
    cmd = peer_command(name, port, policy, workers, prometheus_port, venv)
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=peer_env(), start_new_session=True)


def stop_peer(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the peer's process group, SIGKILL after ``timeout``."""
    stop_group(proc, timeout)


def main(argv: list[str] | None = None) -> int:
    """Run a peer in the foreground until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m bench.peers.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peer", choices=PEERS)
    parser.add_argument("workers", nargs="+", help="worker base URLs")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--prometheus-port", type=int, default=29000)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    args = parser.parse_args(argv)
    try:
        cmd = peer_command(args.peer, args.port, args.policy, args.workers, args.prometheus_port, args.venv)
    except PeerError as exc:
        print(f"bench.peers.launch: {exc}", file=sys.stderr)
        return 2
    return subprocess.call(cmd, env=peer_env())


if __name__ == "__main__":
    raise SystemExit(main())
