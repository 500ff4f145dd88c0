"""``prefixlb worker``: one replica behind the OpenAI API (real engine or ``--simulate``)."""
from __future__ import annotations

import argparse
import logging
import sys

from prefixlb.aio import run as run_loop
from protocol.settings import SettingsError, build_parser, load_settings
from worker.server.config import ENV_PREFIX, ServerConfig, check_server_config

EXAMPLES = """examples:
  prefixlb worker --model tiny --port 8001
  prefixlb worker --model small --port 8002 --kv-memory 512MiB --redis redis://127.0.0.1:6379/0 \\
                  --advertise http://10.0.0.5:8002
  prefixlb worker --simulate --gpu H100-80G --sim-model llama-3-8b --time-scale 10 --port 8003
  prefixlb worker --model DIR --lora sql=/adapters/sql --lora chat=/adapters/chat --max-loras 8
"""


def main(argv: list[str]) -> int:
    """Parse settings, run the worker until SIGTERM, return its exit status."""
    parser = build_parser(ServerConfig, env_prefix=ENV_PREFIX, prog="prefixlb worker",
                          description=__doc__, epilog=EXAMPLES,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    args = parser.parse_args(argv)
    try:
        cfg = load_settings(ServerConfig, args, env_prefix=ENV_PREFIX)
        check_server_config(cfg)
    except SettingsError as exc:
        print(f"prefixlb worker: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from worker.engine.errors import LoRAError, ModelLoadError
    from worker.server.app import serve
    from worker.simulator.profiles import ProfileError

    try:
        return run_loop(serve(cfg))
    except (ModelLoadError, LoRAError, ProfileError, ValueError) as exc:
        print(f"prefixlb worker: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"prefixlb worker: cannot start: {exc}", file=sys.stderr)
        return 1
