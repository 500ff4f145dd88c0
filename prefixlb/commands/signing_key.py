"""``prefixlb signing-key``: a worker's key for signing what it writes into Redis.

Routers take the fleet secret (``--redis-signing-secret``); each worker gets only its own key,
derived from it (``--redis-signing-key``), so a worker cannot sign as another
(protocol/signing.py). The secret is read from ``--secret`` or, better, the environment
variable ``PREFIXLB_REDIS_SIGNING_SECRET`` (a flag is visible in the process list).
"""
from __future__ import annotations

import argparse
import os
import sys

from protocol.signing import worker_key


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prefixlb signing-key", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-id", required=True, help="the worker's --worker-id")
    parser.add_argument("--secret", help="the fleet secret (default: $PREFIXLB_REDIS_SIGNING_SECRET)")
    args = parser.parse_args(argv)
    secret = args.secret or os.environ.get("PREFIXLB_REDIS_SIGNING_SECRET")
    if not secret:
        print("prefixlb signing-key: give --secret or set PREFIXLB_REDIS_SIGNING_SECRET", file=sys.stderr)
        return 2
    print(worker_key(secret, args.worker_id))
    return 0
