"""The bundled Redis takes only clients with a password, and each role only what it needs.

The chart renders the passwords into a Secret (generated once), gives the routers and workers
theirs through the environment (the URL is composed by the kubelet from ``$(REDIS_PASSWORD)``, so
no password is in a flag or the pod spec) and starts Redis with an ACL file written from them.
Here the Redis container's own command is run with a real ``redis-server``, and the real router
and worker code (``RedisState``, ``RedisPublisher``) is run against it as the users the pods log
in as: every command they send must pass (Redis's ACL LOG stays empty), and the commands a
compromised worker or router would want must be refused.
"""
from __future__ import annotations

import base64
import json
from urllib.parse import urlsplit

import helm_python as helm
import pytest

from tests.deploy_support import (
    acl_denials, container, expand_pod_env, find, flags_used, load_router_config, load_server_config, not_refused,
    pod_env, redis_process, redis_server_version, render_chart, run_worker_and_router,
)
from tests.support import free_port

PREFIX = "prefixlb:"
# What a worker holding only its own password must not do: read (another worker's registration,
# the snapshot, the stream), drain or undrain, change the shared config, replace the snapshot,
# delete the stream or the heartbeat set, trim the stream, touch keys outside prefixlb, or run
# server commands.
WORKER_REFUSED = [
    ("GET", f"{PREFIX}worker:other"), ("MGET", f"{PREFIX}load:other"), ("GET", f"{PREFIX}index_snapshot"),
    ("XREAD", "STREAMS", f"{PREFIX}kv_events", "0-0"), ("HSET", f"{PREFIX}drains", "http://10.0.0.9:8000", "1"),
    ("HDEL", f"{PREFIX}drains", "http://10.0.0.9:8000"), ("HSET", f"{PREFIX}config", "affinity", "1"),
    ("HINCRBY", f"{PREFIX}config", "version", "1"), ("SET", f"{PREFIX}index_snapshot", "x"),
    ("DEL", f"{PREFIX}kv_events"), ("DEL", f"{PREFIX}workers"), ("XTRIM", f"{PREFIX}kv_events", "MAXLEN", "0"),
    ("SET", "other-app:key", "x"), ("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST"),
    ("EVAL", "return 1", "0"), ("CLIENT", "KILL", "TYPE", "normal"),
]
# What a router must not do: write a worker's registration or load report, forge KV events,
# delete the stream, register a worker in the heartbeat set, touch keys outside prefixlb, or run
# server commands.
ROUTER_REFUSED = [
    ("SET", f"{PREFIX}worker:worker-0", "{}"), ("SET", f"{PREFIX}load:worker-0", "{}"),
    ("DEL", f"{PREFIX}worker:worker-0"), ("XADD", f"{PREFIX}kv_events", "*", "e", "{}"),
    ("DEL", f"{PREFIX}kv_events"), ("ZADD", f"{PREFIX}workers", "1", "rogue"),
    ("SET", "other-app:key", "x"), ("GET", "other-app:key"), ("FLUSHALL",), ("CONFIG", "GET", "*"),
    ("KEYS", "*"), ("ACL", "LIST"), ("EVAL", "return 1", "0"), ("CLIENT", "KILL", "TYPE", "normal"),
]


def _secret(docs: list[dict]) -> dict[str, str]:
    data = find(docs, "Secret", "-redis")["data"]
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def _redis_container(docs: list[dict]) -> dict:
    return container(find(docs, "StatefulSet", "-redis"), "redis")


def _redis_urls(docs: list[dict]) -> dict[str, str]:
    """{component: the Redis URL its settings loader ends up with}."""
    router, worker = find(docs, "Deployment", "-router"), find(docs, "StatefulSet", "-worker")
    return {
        "router": load_router_config(container(router, "router")["args"],
                                     environ=pod_env(docs, router, "router")).redis,
        "worker": load_server_config(expand_pod_env(container(worker, "worker")["args"]),
                                     environ=pod_env(docs, worker, "worker")).redis,
    }


def test_by_default_the_chart_generates_a_password_for_each_redis_user():
    passwords = _secret(render_chart({}))
    assert sorted(passwords) == ["redis-password", "router-password", "worker-password"]
    for password in passwords.values():
        assert len(password) == 40 and password.isalnum()
    assert len(set(passwords.values())) == 3


def test_routers_and_workers_log_in_to_the_bundled_redis_as_their_own_users():
    docs = render_chart({})
    passwords = _secret(docs)
    service = find(docs, "Service", "-redis")
    address = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert _redis_urls(docs) == {
        "router": f"redis://router:{passwords['router-password']}@{address}/0",
        "worker": f"redis://worker:{passwords['worker-password']}@{address}/0",
    }


def test_no_password_is_in_a_flag_or_the_pod_spec():
    docs = render_chart({})
    passwords = _secret(docs).values()
    for kind, name in (("Deployment", "router"), ("StatefulSet", "worker"), ("StatefulSet", "redis")):
        spec = json.dumps(find(docs, kind, f"-{name}")["spec"])
        assert not [p for p in passwords if p in spec], name
        if name != "redis":
            assert "--redis" not in flags_used(container(find(docs, kind, f"-{name}"), name)["args"]), name
    # A changed password rolls Redis, the routers and the workers.
    for kind, name in (("Deployment", "router"), ("StatefulSet", "worker"), ("StatefulSet", "redis")):
        assert find(docs, kind, f"-{name}")["spec"]["template"]["metadata"]["annotations"]["checksum/redis"]


def test_without_acl_users_routers_and_workers_log_in_as_the_default_user():
    docs = render_chart({"redis": {"auth": {"acl": False}}})
    passwords = _secret(docs)
    assert sorted(passwords) == ["redis-password"]
    assert set(_redis_urls(docs).values()) == {f"redis://:{passwords['redis-password']}@demo-prefixlb-redis:6379/0"}


def test_passwords_from_an_existing_secret_render_no_secret_and_reach_every_pod():
    auth = {"existingSecret": "ops-redis", "passwordKey": "admin", "routerPasswordKey": "r", "workerPasswordKey": "w"}
    docs = render_chart({"redis": {"auth": auth}})
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-redis")]
    refs = {}
    for kind, name in (("Deployment", "router"), ("StatefulSet", "worker"), ("StatefulSet", "redis")):
        for e in container(find(docs, kind, f"-{name}"), name)["env"]:
            if "secretKeyRef" in e.get("valueFrom", {}) and e["name"].startswith("REDIS_"):
                refs[(name, e["name"])] = e["valueFrom"]["secretKeyRef"]
    assert refs == {
        ("router", "REDIS_PASSWORD"): {"name": "ops-redis", "key": "r"},
        ("worker", "REDIS_PASSWORD"): {"name": "ops-redis", "key": "w"},
        ("redis", "REDIS_PASSWORD"): {"name": "ops-redis", "key": "admin"},
        ("redis", "REDIS_ROUTER_PASSWORD"): {"name": "ops-redis", "key": "r"},
        ("redis", "REDIS_WORKER_PASSWORD"): {"name": "ops-redis", "key": "w"},
    }


def test_an_external_redis_keeps_its_url_and_gets_no_password_of_the_charts():
    docs = render_chart({"redis": {"enabled": False, "url": "redis+sentinel://s1:26379,s2:26379/main"}})
    assert _redis_urls(docs) == {"router": "redis+sentinel://s1:26379,s2:26379/main",
                                 "worker": "redis+sentinel://s1:26379,s2:26379/main"}
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-redis")]


@pytest.mark.parametrize("values,message", [
    ({"redis": {"auth": {"routerPasswordKey": "redis-password"}}}, "must differ"),
    ({"redis": {"keyPrefix": "team a:"}}, "/redis/keyPrefix"),
    ({"redis": {"keyPrefix": "team*:"}}, "/redis/keyPrefix"),
])
def test_values_that_would_break_the_acl_fail_the_install(values, message):
    with pytest.raises(helm.HelmError) as exc:
        render_chart(values)
    assert message in str(exc.value)


def _start_command(docs: list[dict], data_dir: str) -> list[str]:
    """The Redis container's command and arguments, with its /data volume at ``data_dir``; on a
    redis-server older than 7.2 (no CLIENT SETINFO, so no such ACL rule) without that rule."""
    c = _redis_container(docs)
    argv = [a.replace("/data/", f"{data_dir}/") for a in c["command"] + c["args"]] + ["--bind", "127.0.0.1"]
    if redis_server_version() < (7, 2):
        argv = [a.replace(" +client|setinfo", "") for a in argv]
    return argv


@pytest.fixture
def chart_redis(tmp_path):
    """The bundled Redis, started by its own container command, and the chart's Secret."""
    port = free_port()
    docs = render_chart({"redis": {"port": port}})
    passwords = _secret(docs)
    env = pod_env(docs, find(docs, "StatefulSet", "-redis"), "redis")
    with redis_process(_start_command(docs, str(tmp_path)), env, port, passwords["redis-password"]) as admin:
        local = {role: url.replace(f"demo-prefixlb-redis:{port}", f"127.0.0.1:{port}")
                 for role, url in _redis_urls(docs).items()}
        yield {"admin": admin, **local}


def test_the_redis_container_refuses_clients_without_the_password(chart_redis):
    import redis

    address = urlsplit(chart_redis["admin"]).netloc.split("@")[1]
    with redis.Redis.from_url(f"redis://{address}/0") as anonymous:
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()
    with redis.Redis.from_url(f"redis://worker:wrong@{address}/0") as wrong:
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()


def test_the_real_router_and_worker_code_runs_as_its_acl_user_without_a_refusal(chart_redis):
    run = run_worker_and_router(chart_redis["router"], chart_redis["worker"], chart_redis["admin"], PREFIX)
    assert acl_denials(chart_redis["admin"]) == []
    assert run.worker_failures == 0 and run.worker_heartbeats >= 1 and run.worker_events_published == 1
    assert run.router_saw_worker and run.router_events_applied == 1
    assert (run.router_resync, run.config_version, run.pruned) == ("ok", 1, True)
    assert (run.drains_left, run.worker_keys_left) == (1, 0)  # one drain shared and kept; deregistered


@pytest.mark.parametrize("role,refused", [("worker", WORKER_REFUSED), ("router", ROUTER_REFUSED)])
def test_each_role_is_refused_what_it_does_not_need(chart_redis, role, refused):
    assert not_refused(chart_redis[role], refused) == []
    assert {entry["username"] for entry in acl_denials(chart_redis["admin"])} == {role}
