"""The docker-compose.yml stack, run as local processes: a working endpoint on both routers.

There is no Docker engine here, so the containers cannot run; what can run is exactly what they
would: each service's command from the compose file (as Docker Compose resolves it), started as
``prefixlb <component> <command>``, with only the addresses rewritten to loopback — the compose
service names become 127.0.0.1 ports, the compose Redis (with its generated per-role passwords,
checked by tests/unit/test_compose.py) becomes the test Redis under a private key prefix. The official ``openai`` client then calls both routers. The stack runs with the API
keys an operator sets in the environment (clients -> routers, routers -> workers), and signed:
the one-shot ``signing-keys`` script runs as written (with this checkout's ``prefixlb``) and
writes each worker's own key, which the worker reads from its file, while the routers get the
fleet secret as their entrypoint gives it; so both workers being routable proves that what
each one writes into Redis passes the routers' signature check.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import pytest

from tests.deploy_support import COMPOSE_FILE, compose_binary
from tests.support import ROOT, free_port, processes, spawn, wait_for


CLIENT_KEY, WORKER_KEY = "compose-client-key", "compose-worker-key"


def _resolved_services() -> dict[str, dict]:
    proc = subprocess.run([str(compose_binary()), "-f", str(COMPOSE_FILE), "config", "--format", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PREFIXLB_ADMIN_TOKEN": "compose-token",
                               "PREFIXLB_API_KEYS": CLIENT_KEY, "PREFIXLB_WORKER_API_KEY": WORKER_KEY})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def _local_args(command: list[str], ports: dict[str, int], redis_url: str) -> list[str]:
    """The service's command with compose addresses mapped to loopback."""
    out = []
    for arg in command:
        arg = arg.replace("redis://redis:6379/0", redis_url)
        arg = re.sub(r"http://([\w-]+):8000", lambda m: f"http://127.0.0.1:{ports[m.group(1)]}", arg)
        out.append(arg)
    for i, arg in enumerate(out[:-1]):
        if arg == "--host":
            out[i + 1] = "127.0.0.1"  # tests listen on loopback only
        if arg == "--worker-allow" and out[i + 1] == "worker-*:8000":
            out[i + 1] = "127.0.0.1"  # the compose workers' names are loopback ports here
    return out


def _signing_volumes(service: dict, work) -> dict[str, str]:
    """Run the ``signing-keys`` one-shot's script as written, its volumes as directories under
    ``work`` and the fleet secret as redis-secrets makes it; {volume: directory}."""
    volumes = {m["source"]: str(work / m["source"]) for m in service["volumes"]}
    for path in volumes.values():
        os.makedirs(path, exist_ok=True)
    with open(os.path.join(volumes["signing-fleet"], "secret"), "w") as fh:
        fh.write(secrets.token_hex(32))
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "prefixlb").write_text(f"#!/bin/sh\ncd {ROOT} && exec {sys.executable} -m prefixlb \"$@\"\n")
    (bin_dir / "prefixlb").chmod(0o755)
    script = service["command"][0].replace("$$", "$")
    for mount in sorted(service["volumes"], key=lambda m: -len(m["target"])):
        script = script.replace(mount["target"] + "/", volumes[mount["source"]] + "/")
    proc = subprocess.run(["sh", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return volumes


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server_url):
    import redis

    # Redis and its one-shot password maker are the test Redis here; the routers and workers build
    # their --redis URL (with their role's password) in their entrypoint, so it is passed directly.
    resolved = _resolved_services()
    services = {n: s for n, s in resolved.items() if not n.startswith("redis") and n != "signing-keys"}
    ports = {name: free_port() for name in services}
    admin_ports: dict[str, int] = {}
    prefix = f"prefixlb-test-{uuid.uuid4().hex[:10]}:"
    logs = tmp_path_factory.mktemp("compose-stack")
    volumes = _signing_volumes(resolved["signing-keys"], logs)
    try:
        with processes() as procs:
            # Workers first and in parallel (the model load dominates), then the routers.
            order = sorted(services, key=lambda n: (not n.startswith("worker"), n))
            for name in order:
                component = name.split("-")[0]
                args = _local_args(services[name]["command"], ports, redis_url=redis_server_url)
                args[args.index("--port") + 1] = str(ports[name])
                if "--admin-port" in args:
                    admin_ports[name] = free_port()
                    args[args.index("--admin-port") + 1] = str(admin_ports[name])
                args += ["--redis", redis_server_url, "--redis-prefix", prefix]
                env = {k: str(v) for k, v in (services[name].get("environment") or {}).items()}
                for mount in services[name].get("volumes", []):  # the signing volumes as directories here
                    if mount["source"] in volumes:
                        env = {k: v.replace(mount["target"], volumes[mount["source"]]) for k, v in env.items()}
                if component == "router":  # what its entrypoint exports from $SIGNING_SECRET_FILE
                    with open(env.pop("SIGNING_SECRET_FILE")) as fh:
                        env["PREFIXLB_ROUTER_REDIS_SIGNING_SECRET"] = fh.read()
                procs.append(spawn([component, *args], logs, name, ports[name], ready_path=None, env=env))
            routers = {p.log.stem: p for p in procs if p.log.stem.startswith("router")}

            def settled() -> str | None:
                dead = [p.log.stem for p in procs if not p.alive()]
                if dead:
                    return "exited: " + ", ".join(dead)
                for p in routers.values():
                    with urllib.request.urlopen(p.url + "/health", timeout=2) as resp:
                        if json.load(resp)["routable_workers"] != 2:
                            return None
                return "ready"

            state = wait_for(settled, 120, interval=0.25, what="both routers routing to both workers")
            assert state == "ready", state + "\n" + "\n".join(p.output()[-2000:] for p in procs if not p.alive())
            yield {"routers": {name: p.url for name, p in routers.items()},
                   "admin": {name: f"http://127.0.0.1:{admin_ports[name]}" for name in routers},
                   "workers": {p.log.stem: p.url for p in procs if p.log.stem.startswith("worker")}}
    finally:
        client = redis.Redis.from_url(redis_server_url)
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def test_both_routers_answer_with_the_openai_client_and_share_where_a_prefix_lives(stack):
    from openai import OpenAI

    routers = stack["routers"]
    assert sorted(routers) == ["router-1", "router-2"]
    prompt = "You are the compose stack's assistant. " * 12 + "Question: what is a KV cache?"
    seen = []
    for name in ("router-1", "router-2", "router-1"):
        client = OpenAI(base_url=routers[name] + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=60)
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=4)
        completion = raw.parse()
        assert completion.choices[0].text is not None
        seen.append((raw.headers["X-Prefixlb-Worker"], completion.usage.prompt_tokens_details.cached_tokens))
    workers = {w for w, _ in seen}
    assert len(workers) == 1, f"the same prefix went to different workers: {seen}"
    assert seen[0][1] == 0 and seen[1][1] > 0 and seen[2][1] > 0, seen


def test_routers_refuse_clients_without_the_api_key_and_workers_refuse_anyone_but_the_routers(stack):
    import openai
    from openai import OpenAI

    for base in (*stack["routers"].values(), *stack["workers"].values()):
        client = OpenAI(base_url=base + "/v1", api_key="wrong-key", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="hello", max_tokens=1)
    # The routers' own key is the workers' key: a client's key does not open a worker.
    worker = OpenAI(base_url=next(iter(stack["workers"].values())) + "/v1", api_key=CLIENT_KEY,
                    max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        worker.completions.create(model="tiny", prompt="hello", max_tokens=1)


def test_the_admin_api_answers_on_the_admin_port_and_not_on_the_api_port(stack):
    token = {"Authorization": "Bearer compose-token"}
    for name, base in stack["routers"].items():
        request = urllib.request.Request(stack["admin"][name] + "/admin/workers", headers=token)
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert len(json.load(resp)["workers"]) == 2, name
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(base + "/admin/workers", headers=token), timeout=10)
        assert refused.value.code == 404, name
