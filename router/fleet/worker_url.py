"""Which worker URLs a router accepts: absolute http(s) URLs, optionally only from an allow-list.

A worker can be added by the admin API, by self-registration in Redis and by Kubernetes
discovery, and the router then sends it requests (with their prompts and headers) and probes.
So a worker URL is checked before it is ever used, whatever its source:

* scheme ``http`` or ``https``, a host, a valid port; no user-info, query or fragment (a URL
  like ``http://user:pw@host`` or ``http://host/?x`` is not a worker base URL);
* when ``--worker-allow`` patterns are configured, the host (and port) must match one:

  ==========================  =====================================================
  pattern                     matches
  ==========================  =====================================================
  ``10.0.0.0/8``, ``fd00::/8``  an IP-literal host inside the network
  ``127.0.0.1``, ``::1``        that IP-literal host
  ``*.workers.svc.local``       a host name, shell-style wildcards (case-insensitive)
  ``<any of the above>:8000``   the same, and only that port (``[::1]:8000`` for IPv6)
  ==========================  =====================================================

Host names are matched as written, never resolved: a name pattern admits names, a network
pattern admits IP literals. Without patterns every http(s) host is accepted (the default, for
a router whose admin token and Redis are trusted).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit


class InvalidWorkerURL(ValueError):
    """A worker URL that is not an acceptable absolute http(s) URL, or not allowed."""


@dataclass(frozen=True, slots=True)
class _Pattern:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    name: str | None
    port: int | None

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        if self.network is not None:
            try:
                return ipaddress.ip_address(host) in self.network
            except ValueError:
                return False
        assert self.name is not None
        return fnmatch.fnmatchcase(host.lower(), self.name)


def _parse_pattern(text: str) -> _Pattern:
    raw = text.strip()
    if not raw:
        raise ValueError("empty worker allow-list pattern")
    port: int | None = None
    host = raw
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise ValueError(f"bad worker allow-list pattern {text!r}")
        host, rest = raw[1:end], raw[end + 1:]
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"bad worker allow-list pattern {text!r}")
            port = int(rest[1:])
    elif raw.count(":") == 1:
        host, _, port_text = raw.partition(":")
        if not port_text.isdigit():
            raise ValueError(f"bad worker allow-list pattern {text!r}")
        port = int(port_text)
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"bad port in worker allow-list pattern {text!r}")
    try:
        return _Pattern(ipaddress.ip_network(host, strict=False), None, port)
    except ValueError:
        pass
    if not host or any(c in host for c in "/@ "):
        raise ValueError(f"bad worker allow-list pattern {text!r}")
    return _Pattern(None, host.lower(), port)


class WorkerURLPolicy:
    """Normalises worker URLs and enforces the optional allow-list (see the module docstring)."""

    def __init__(self, allow: Sequence[str] = ()) -> None:
        self.patterns = tuple(_parse_pattern(p) for p in allow)

    def check(self, url: object) -> str:
        """``url`` without a trailing slash; raises :class:`InvalidWorkerURL` if not acceptable."""
        if not isinstance(url, str):
            raise InvalidWorkerURL("a worker URL must be a string")
        text = url.strip()
        if len(text) > 2048 or any(ord(c) < 0x21 or ord(c) == 0x7F for c in text):
            raise InvalidWorkerURL("a worker URL must be a short URL without spaces or control characters")
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidWorkerURL(f"not an http(s) worker URL: {url!r}")
        if parts.username is not None or parts.password is not None or "@" in parts.netloc:
            raise InvalidWorkerURL(f"a worker URL must not carry credentials: {url!r}")
        if parts.query or parts.fragment or "?" in text or "#" in text:
            raise InvalidWorkerURL(f"a worker URL must not have a query or fragment: {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise InvalidWorkerURL(f"bad port in worker URL: {url!r}") from None
        if self.patterns and not any(p.matches(parts.hostname, port) for p in self.patterns):
            raise InvalidWorkerURL(f"worker URL not in the allow-list (--worker-allow): {url!r}")
        return text.rstrip("/")

    def check_host(self, host: str) -> None:
        """Raise :class:`InvalidWorkerURL` unless ``host`` is allowed on any port (the KV-event
        sockets of a worker live on other ports than its HTTP one)."""
        if self.patterns and not any(dataclasses.replace(p, port=None).matches(host, 0) for p in self.patterns):
            raise InvalidWorkerURL(f"KV-event host not in the allow-list (--worker-allow): {host!r}")


def normalize_url(url: object) -> str:
    """``url`` checked as an http(s) worker URL (no allow-list), without a trailing slash."""
    return WorkerURLPolicy().check(url)
