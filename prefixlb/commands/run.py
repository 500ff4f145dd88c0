"""``prefixlb run``: a local cluster -- CPU workers with the tiny model and a router in front.

What ``make run`` starts: 2 workers as child processes on free loopback ports and the router on
127.0.0.1:8000, with in-memory state (no Redis). Prints how to call it; Ctrl-C or SIGTERM stops
the router and the workers.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``prefixlb run``."""
    p = argparse.ArgumentParser(prog="prefixlb run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="router address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="router port (default: 8000)")
    p.add_argument("--workers", type=int, default=2, help="number of CPU workers (default: 2)")
    p.add_argument("--model", default="tiny", help="worker model preset or checkpoint (default: tiny)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: 1)")
    p.add_argument("--policy", default=None, help="routing policy (default: the router's)")
    p.add_argument("--affinity", type=float, default=None, help="affinity strength 0..1 (default: the router's)")
    p.add_argument("--admin-token", default=None, help="admin API token (default: a random one, printed)")
    p.add_argument("--simulate", action="store_true", help="simulated workers instead of the tiny engine")
    return p


def main(argv: list[str]) -> int:
    """Start the workers, then serve the router until Ctrl-C/SIGTERM; stop everything."""
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("prefixlb run: --workers must be at least 1", file=sys.stderr)
        return 2
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from prefixlb.launcher import LaunchError, LocalWorkers, instructions, local_workers
    from prefixlb.aio import run as run_loop
    from protocol.settings import SettingsError
    from router.app import serve
    from router.config import load_router_config

    token = args.admin_token or secrets.token_urlsafe(16)
    extra = ["--simulate"] if args.simulate else []
    workers = LocalWorkers(args.workers, args.model, args.threads, extra)
    print(f"prefixlb run: starting {args.workers} worker(s) ({args.model})...", file=sys.stderr, flush=True)
    try:
        with local_workers(workers) as urls:
            router_argv = ["--host", args.host, "--port", str(args.port),
                           "--admin-token", token, *[a for u in urls for a in ("--worker", u)]]
            if args.policy is not None:
                router_argv += ["--policy", args.policy]
            if args.affinity is not None:
                router_argv += ["--affinity", str(args.affinity)]
            cfg = load_router_config(router_argv, environ={})
            model = "llama-3-8b" if args.simulate else args.model
            ready = asyncio.Event()

            async def run() -> int:
                async def announce() -> None:
                    await ready.wait()
                    print(instructions(args.host, args.port, model, urls, token), flush=True)

                task = asyncio.create_task(announce())
                try:
                    return await serve(cfg, ready)
                finally:
                    task.cancel()

            return run_loop(run())
    except (LaunchError, SettingsError) as exc:
        print(f"prefixlb run: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"prefixlb run: cannot start the router: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
