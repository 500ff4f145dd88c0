"""``prefixlb signing-key``: a worker's key for signing what it writes into Redis.

Routers take the fleet secret (``--redis-signing-secret``); each worker gets only its own key,
derived from it (``--redis-signing-key``), so a worker cannot sign as another
(protocol/signing.py). The secret is read from ``--secret`` or, better, the environment
variable ``PREFIXLB_REDIS_SIGNING_SECRET`` (a flag is visible in the process list).

With ``--out FILE`` the key is written to FILE (mode 0400, replaced atomically) instead of
printed: the Helm chart's init container and compose's ``signing-keys`` service write each
worker's key where only that worker reads it (``prefixlb worker --redis-signing-key-file``).
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
    parser.add_argument("--out", metavar="FILE", help="write the key to FILE (mode 0400) instead of printing it")
    args = parser.parse_args(argv)
    secret = args.secret or os.environ.get("PREFIXLB_REDIS_SIGNING_SECRET")
    if not secret:
        print("prefixlb signing-key: give --secret or set PREFIXLB_REDIS_SIGNING_SECRET", file=sys.stderr)
        return 2
    key = worker_key(secret, args.worker_id)
    if args.out is None:
        print(key)
        return 0
    tmp = f"{args.out}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as fh:
            fh.write(key + "\n")
        os.replace(tmp, args.out)
    except OSError as exc:
        print(f"prefixlb signing-key: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    return 0
