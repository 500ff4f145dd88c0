"""Which worker URLs a router accepts: absolute http(s) URLs, optionally only from an allow-list.

A worker can be added by the admin API, by self-registration in Redis and by Kubernetes
discovery, and the router then sends it requests (with their prompts and headers) and probes.
So a worker URL is checked before it is ever used, whatever its source:

* scheme ``http`` or ``https``, a host, a valid port; no user-info, query or fragment (a URL
  like ``http://user:pw@host`` or ``http://host/?x`` is not a worker base URL);
* link-local and cloud-metadata hosts (``169.254.0.0/16``, ``fe80::/10``, ``fd00:ec2::254``,
  ``metadata.google.internal``) are refused unless an allow-list pattern matches them: no
  worker lives there, a credentials endpoint does. Loopback is accepted (local clusters,
  ``make run`` and the tests run their workers on 127.0.0.1);
* when ``--worker-allow`` patterns are configured, the host (and port) must match one:

  ==========================  =====================================================
  pattern                     matches
  ==========================  =====================================================
  ``10.0.0.0/8``, ``fd00::/8``  an IP-literal host inside the network
  ``127.0.0.1``, ``::1``        that IP-literal host
  ``*.workers.svc.local``       a host name; ``*`` (any run of characters) and ``?`` (one)
                                match within one DNS label, never across a dot
                                (case-insensitive)
  ``<any of the above>:8000``   the same, and only that port (``[::1]:8000`` for IPv6)
  ==========================  =====================================================

Host names are matched as written, never resolved: a name pattern admits names, a network
pattern admits IP literals (in any spelling the resolver accepts: ``2852039166`` is
169.254.169.254). Without patterns every other http(s) host is accepted (the default, for a
router whose admin token and Redis are trusted).
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class InvalidWorkerURL(ValueError):
    """A worker URL that is not an acceptable absolute http(s) URL, or not allowed."""


LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
METADATA_ADDRESSES = (ipaddress.ip_address("fd00:ec2::254"),)  # AWS's over IPv6 (IPv4: link-local)
METADATA_NAMES = ("metadata.google.internal",)


def _address(host: str) -> IPAddress | None:
    """The IP address ``host`` spells, or None for a name. Legacy IPv4 spellings the resolver
    accepts (``2852039166``, ``0xa9fea9fe``, ``169.254.43518``) count as the address they are,
    and an IPv4-mapped IPv6 address as its IPv4 one."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_metadata_or_link_local(host: str) -> bool:
    """Whether ``host`` is a link-local or cloud-metadata address or name."""
    address = _address(host)
    if address is None:
        return host.lower().rstrip(".") in METADATA_NAMES
    return address in METADATA_ADDRESSES or any(address in net for net in LINK_LOCAL)


def _label_glob(pattern: str) -> re.Pattern[str]:
    """``*`` and ``?`` of a host-name pattern, within one DNS label."""
    parts = ("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in pattern)
    return re.compile("".join(parts))


@dataclass(frozen=True, slots=True)
class _Pattern:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    name: re.Pattern[str] | None
    port: int | None

    def matches(self, host: str, port: int | None) -> bool:
        """Whether ``host`` (and ``port``; None: any) is inside this pattern."""
        if self.port is not None and port is not None and port != self.port:
            return False
        if self.network is not None:
            address = _address(host)
            return address is not None and address in self.network
        assert self.name is not None
        return self.name.fullmatch(host.lower().rstrip(".")) is not None


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
    return _Pattern(None, _label_glob(host.lower().rstrip(".")), port)


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
        self._check_allowed(parts.hostname, port, f"worker URL {url!r}")
        return text.rstrip("/")

    def check_host(self, host: str) -> None:
        """Raise :class:`InvalidWorkerURL` unless ``host`` is allowed on any port (the KV-event
        sockets of a worker live on other ports than its HTTP one)."""
        self._check_allowed(host, None, f"KV-event host {host!r}")

    def _check_allowed(self, host: str, port: int | None, what: str) -> None:
        listed = any(p.matches(host, port) for p in self.patterns)
        if self.patterns and not listed:
            raise InvalidWorkerURL(f"{what} not in the allow-list (--worker-allow)")
        if not listed and is_metadata_or_link_local(host):
            raise InvalidWorkerURL(f"{what} is a link-local or cloud-metadata address; "
                                   "list it in --worker-allow if a worker really lives there")


def normalize_url(url: object) -> str:
    """``url`` checked as an http(s) worker URL (no allow-list), without a trailing slash."""
    return WorkerURLPolicy().check(url)
