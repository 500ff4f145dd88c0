"""``--redis`` URLs are checked at start: a malformed one is one clear message, not a traceback."""
from __future__ import annotations

import pytest

from protocol.redis_url import RedisURLError, check_redis_url


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://:secret@redis:6379", "rediss://user:pw@redis.example.com:6380/2",
    "unix:///run/redis/redis.sock", "redis://redis", "redis+sentinel://s1:26379,s2:26379/mymaster/1",
])
def test_well_formed_redis_urls_pass(url):
    check_redis_url(url)


@pytest.mark.parametrize("url, message", [
    ("redis://host:notaport/0", "the port is not a number from 1 to 65535"),
    ("redis://host:70000/0", "the port is not a number from 1 to 65535"),
    ("redis://host:0/0", "the port is not a number from 1 to 65535"),
    ("redis:///0", "no host"),
    ("redis://host:6379/zero", "the database after the host is a number, not 'zero'"),
    ("unix://", "needs the socket's path"),
    ("http://host:6379", "unsupported Redis URL scheme 'http'"),
    ("127.0.0.1:6379", "unsupported Redis URL scheme"),
    ("redis://host:6379/0?socket_timeout=soon", "Invalid value for 'socket_timeout'"),
    ("redis+sentinel://s1/mymaster", "every sentinel is host:port"),
])
def test_malformed_redis_urls_are_refused_naming_the_problem(url, message):
    with pytest.raises(RedisURLError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_redis_url(url)


def test_the_password_of_a_malformed_url_is_not_repeated_in_the_message():
    with pytest.raises(RedisURLError) as exc:
        check_redis_url("redis://:hunter2@host:port/0")
    assert "hunter2" not in str(exc.value) and "***" in str(exc.value)
