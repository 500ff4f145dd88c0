"""``prefixlb router``: the cache-aware router, an OpenAI-compatible ingress to the workers."""
from __future__ import annotations

from prefixlb.server_command import ServerCommand
from router.config import ENV_PREFIX, HELP_GROUPS, RouterConfig, check_router_config

EXAMPLES = """examples:
  prefixlb router --port 8000 --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002
  prefixlb router --redis redis://127.0.0.1:6379/0 --affinity 0.8 --admin-token s3cret
  prefixlb router --policy least_load --worker http://10.0.0.5:8000
  prefixlb router --processes 4 --redis redis://127.0.0.1:6379/0 --port 8000
  prefixlb router --worker vllm=http://10.0.0.5:8000,kv-events=tcp://10.0.0.5:5557,kv-replay=tcp://10.0.0.5:5558 \
                  --tokenizer meta-llama/Llama-3.1-8B-Instruct=/models/llama-3.1-8b

per request: header X-Prefixlb-Affinity: 0..1 overrides --affinity
"""


def settings_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "these settings cannot start a router" (exit 2)."""
    from router.fleet.backends import InvalidWorkerSpec
    from router.fleet.registry import InvalidWorkerURL
    from router.fleet.tokenizers import TokenizerLoadError

    return InvalidWorkerURL, InvalidWorkerSpec, TokenizerLoadError


def _load():
    from router.app import serve

    return _serve_or_supervise(serve), settings_errors()


def _serve_or_supervise(serve):
    async def run(cfg: RouterConfig) -> int:
        if cfg.processes > 1:
            from prefixlb.processes import supervise

            return await supervise(cfg)
        return await serve(cfg)
    return run


COMMAND = ServerCommand(name="router", schema=RouterConfig, env_prefix=ENV_PREFIX, description=__doc__,
                        epilog=EXAMPLES, load=_load, check=check_router_config, help_groups=HELP_GROUPS)


def main(argv: list[str]) -> int:
    """Parse settings, run the router until SIGTERM, return its exit status."""
    return COMMAND.main(argv)
