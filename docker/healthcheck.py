"""Container health check: exit 0 when the local prefixlb server answers ``GET /health`` with 2xx.

Used by the images' ``HEALTHCHECK`` (slim images carry no curl). The URL is
``PREFIXLB_HEALTHCHECK_URL`` if set, else ``http://127.0.0.1:<port>/health`` with the port from
``PREFIXLB_ROUTER_PORT`` or ``PREFIXLB_WORKER_PORT`` (whichever the image sets), else 8000.
A worker that is draining answers 503, so it turns unhealthy on purpose while it drains.
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def health_url(environ: dict[str, str]) -> str:
    """The URL to probe, from the environment."""
    if environ.get("PREFIXLB_HEALTHCHECK_URL"):
        return environ["PREFIXLB_HEALTHCHECK_URL"]
    port = environ.get("PREFIXLB_ROUTER_PORT") or environ.get("PREFIXLB_WORKER_PORT") or "8000"
    return f"http://127.0.0.1:{port}/health"


def main() -> int:
    """Probe once; 0 = healthy, 1 = not (the Docker HEALTHCHECK convention)."""
    url = health_url(dict(os.environ))
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("PREFIXLB_HEALTHCHECK_TIMEOUT", "2"))) as resp:
            healthy = 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"event=healthcheck_failed url={url} error={exc!r}", file=sys.stderr)
        return 1
    if not healthy:
        print(f"event=healthcheck_failed url={url} status={resp.status}", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
