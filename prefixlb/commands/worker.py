"""``prefixlb worker``: one replica behind the OpenAI API (real engine or ``--simulate``)."""
from __future__ import annotations

from prefixlb.server_command import ServerCommand
from worker.server.config import ENV_PREFIX, HELP_GROUPS, ServerConfig, check_server_config

EXAMPLES = """examples:
  prefixlb worker --model tiny --port 8001
  prefixlb worker --model small --port 8002 --kv-memory 512MiB --redis redis://127.0.0.1:6379/0 \\
                  --advertise http://10.0.0.5:8002
  prefixlb worker --simulate --gpu H100-80G --sim-model llama-3-8b --time-scale 10 --port 8003
  prefixlb worker --model DIR --lora sql=/adapters/sql --lora chat=/adapters/chat --max-loras 8
"""


def _load():
    from worker.engine.errors import LoRAError, ModelLoadError
    from worker.server.app import serve
    from worker.simulator.profiles import ProfileError

    return serve, (ModelLoadError, LoRAError, ProfileError, ValueError)


COMMAND = ServerCommand(name="worker", schema=ServerConfig, env_prefix=ENV_PREFIX, description=__doc__,
                        epilog=EXAMPLES, load=_load, check=check_server_config, help_groups=HELP_GROUPS)


def main(argv: list[str]) -> int:
    """Parse settings, run the worker until SIGTERM, return its exit status."""
    return COMMAND.main(argv)
