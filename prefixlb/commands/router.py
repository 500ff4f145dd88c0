"""``prefixlb router``: the cache-aware router, an OpenAI-compatible ingress to the workers."""
from __future__ import annotations

import argparse
import logging
import sys

from prefixlb.aio import run as run_loop
from protocol.settings import SettingsError, build_parser, load_settings
from router.config import ENV_PREFIX, RouterConfig

EXAMPLES = """examples:
  prefixlb router --port 8000 --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002
  prefixlb router --redis redis://127.0.0.1:6379/0 --affinity 0.8 --admin-token s3cret
  prefixlb router --policy least_load --worker http://10.0.0.5:8000

per request: header X-Prefixlb-Affinity: 0..1 overrides --affinity
"""


def main(argv: list[str]) -> int:
    """Parse settings, run the router until SIGTERM, return its exit status."""
    parser = build_parser(RouterConfig, env_prefix=ENV_PREFIX, prog="prefixlb router", description=__doc__,
                          epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = parser.parse_args(argv)
    try:
        cfg = load_settings(RouterConfig, args, env_prefix=ENV_PREFIX)
    except SettingsError as exc:
        print(f"prefixlb router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from router.app import serve
    from router.fleet.registry import InvalidWorkerURL

    try:
        return run_loop(serve(cfg))
    except InvalidWorkerURL as exc:
        print(f"prefixlb router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"prefixlb router: cannot start: {exc}", file=sys.stderr)
        return 1
