"""Redis connections from one URL, plain or through Sentinel (high availability).

Routers and workers take the same ``--redis`` URL:

* ``redis://[[user]:password@]host:port[/db]``, ``rediss://...`` (TLS), ``unix:///path`` --
  redis-py's own URL forms;
* ``redis+sentinel://[[user]:password@]host1:port1[,host2:port2...]/SERVICE[/db]`` -- ask the
  sentinels for the current primary of ``SERVICE`` (``sentinel monitor SERVICE ...``) and follow
  it through a failover: a connection that finds a replica (or nothing) where the primary was
  asks the sentinels again. The password (and user) are the data nodes'; sentinels that need
  their own take ``?sentinel_password=...``.

``protocol.settings.redact_url`` gives such a URL with its password masked, for logs.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"


class RedisURLError(ValueError):
    """A ``--redis`` URL that cannot be used."""


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int, dict[str, Any]]:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    nodes = []
    for item in netloc.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RedisURLError(f"redis+sentinel: every sentinel is host:port, got {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise RedisURLError("redis+sentinel URL must end in /SERVICE or /SERVICE/DB")
    auth: dict[str, Any] = {}
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        user, _, password = userinfo.partition(":")
        if user:
            auth["username"] = unquote(user)
        if password:
            auth["password"] = unquote(password)
    query = parse_qs(parts.query)
    if "sentinel_password" in query:
        auth["sentinel_password"] = query["sentinel_password"][0]
    return nodes, path[0], int(path[1]) if len(path) == 2 else 0, auth


def check_redis_url(url: str) -> None:
    """Raise :class:`RedisURLError`, with a message naming the problem, unless ``url`` is a Redis
    URL this module can open: a known scheme, a host (or a socket path), a numeric port in range,
    a numeric database, options redis-py accepts."""
    from redis.connection import parse_url

    from protocol.settings import redact_url

    parts = urlsplit(url.strip())
    scheme = parts.scheme
    if scheme == SENTINEL_SCHEME:
        _sentinel_parts(url)
        return
    if scheme not in ("redis", "rediss", "unix"):
        raise RedisURLError(f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)!r} "
                            "(redis://HOST:PORT/DB, rediss://, unix:///PATH, redis+sentinel://)")
    shown = redact_url(url)
    try:
        port = parts.port
    except ValueError:
        raise RedisURLError(f"{shown!r}: the port is not a number from 1 to 65535") from None
    if scheme == "unix":
        if not parts.path:
            raise RedisURLError(f"{shown!r}: a unix:// URL needs the socket's path (unix:///run/redis.sock)")
    else:
        if not parts.hostname:
            raise RedisURLError(f"{shown!r}: no host (redis://HOST:PORT/DB)")
        if port == 0:
            raise RedisURLError(f"{shown!r}: the port is not a number from 1 to 65535")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise RedisURLError(f"{shown!r}: the database after the host is a number, not {db!r}")
    try:
        parse_url(url)
    except ValueError as exc:
        raise RedisURLError(f"{shown!r}: {exc}") from None


def redis_client(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (see the module docstring); ``options`` are
    redis-py's connection options (timeouts, ...). Connects lazily."""
    if urlsplit(url).scheme != SENTINEL_SCHEME:
        return aioredis.Redis.from_url(url, **options)
    nodes, service, db, auth = _sentinel_parts(url)
    sentinel_password = auth.pop("sentinel_password", None)
    timeouts = {k: v for k, v in options.items() if k in ("socket_timeout", "socket_connect_timeout")}
    sentinel = Sentinel(nodes, sentinel_kwargs={**timeouts, "password": sentinel_password}, **timeouts)
    return sentinel.master_for(service, redis_class=aioredis.Redis, db=db, **auth, **options)
