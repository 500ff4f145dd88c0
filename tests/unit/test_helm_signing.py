"""The chart hands each worker pod its own Redis signing key, and no worker container the fleet secret.

The fleet secret (protocol/signing.py) is in a Secret the chart generates; the routers get it
(``--redis-signing-secret`` from the environment); in a worker pod only the ``signing-key`` init
container reads it, runs ``prefixlb signing-key`` for the pod's name (its worker id) and writes
the key into an in-memory volume the worker container reads (``--redis-signing-key-file``). Here
the init container's command is run for real, as the kubelet would start it, and the worker's
and router's settings are loaded from what the chart gives them.
"""
from __future__ import annotations

import base64
import subprocess
import sys

from protocol.signing import worker_key
from tests.deploy_support import (
    POD_ENV, container, expand_pod_env, find, load_router_config, load_server_config, pod_env, render_chart,
)
from tests.support import ROOT
from worker.server.config import signing_key

SECRET_NAME = "demo-prefixlb-signing"


def _secret(docs: list[dict], name: str = SECRET_NAME) -> str:
    data = find(docs, "Secret", name)["data"]
    return base64.b64decode(data["signing-secret"]).decode()


def _references(obj: object, secret: str) -> bool:
    """Whether ``obj`` (a container or a volume list) names Secret ``secret`` anywhere."""
    if isinstance(obj, dict):
        if obj.get("name") == secret and ("key" in obj or "secretName" in obj):
            return True
        if obj.get("secretName") == secret:
            return True
        return any(_references(v, secret) for v in obj.values())
    if isinstance(obj, list):
        return any(_references(v, secret) for v in obj)
    return False


def test_the_chart_generates_a_fleet_secret_and_only_routers_and_the_init_container_read_it():
    docs = render_chart({})
    secret = _secret(docs)
    assert len(secret) == 64 and secret.isalnum()
    router = find(docs, "Deployment", "-router")
    assert load_router_config(container(router, "router")["args"],
                              environ=pod_env(docs, router, "router")).redis_signing_secret == secret
    worker = find(docs, "StatefulSet", "-worker")
    pod = worker["spec"]["template"]["spec"]
    readers = [c["name"] for c in [*pod["containers"], *pod["initContainers"]] if _references(c, SECRET_NAME)]
    assert readers == ["signing-key"]
    assert not _references(pod["volumes"], SECRET_NAME)  # not mountable by any container of the pod
    # the key lives in memory, and the worker container mounts it read-only
    volume = next(v for v in pod["volumes"] if v["name"] == "signing-key")
    assert volume["emptyDir"]["medium"] == "Memory"
    mount = next(m for m in container(worker, "worker")["volumeMounts"] if m["name"] == "signing-key")
    assert mount["readOnly"] is True


def test_the_init_container_writes_the_pods_own_key_and_the_worker_signs_with_it(tmp_path):
    docs = render_chart({})
    secret = _secret(docs)
    worker = find(docs, "StatefulSet", "-worker")
    init = container(worker, "signing-key")
    mount = next(m["mountPath"] for m in init["volumeMounts"] if m["name"] == "signing-key")
    volume = tmp_path / "signing-key"
    volume.mkdir()
    # `prefixlb signing-key ...` as the kubelet starts it, the volume's path mapped to a directory here
    argv = [a.replace(mount, str(volume)) for a in expand_pod_env(init["command"][1:] + init["args"])]
    env = {**pod_env(docs, worker, "signing-key"), "PATH": "/usr/bin:/bin"}
    assert init["command"][0] == "prefixlb"
    proc = subprocess.run([sys.executable, "-m", "prefixlb", *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (volume / "key").stat().st_mode & 0o777 == 0o400
    # the worker container: its settings from the chart, the key file from the volume
    environ = {k: v.replace(mount, str(volume)) for k, v in pod_env(docs, worker, "worker").items()}
    cfg = load_server_config(expand_pod_env(container(worker, "worker")["args"]), environ=environ)
    assert cfg.worker_id == POD_ENV["POD_NAME"]
    assert cfg.redis_signing_key is None and signing_key(cfg) == worker_key(secret, POD_ENV["POD_NAME"])
    assert secret not in " ".join([*environ.values(), *container(worker, "worker")["args"]])


def test_the_generated_secret_changes_the_pods_checksums_and_an_existing_secret_is_used_as_is():
    docs = render_chart({"redis": {"signing": {"existingSecret": "fleet-signing", "secretKey": "s"}}})
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret" and "signing" in d["metadata"]["name"]] == []
    router_env = {e["name"]: e for e in container(find(docs, "Deployment", "-router"), "router")["env"]}
    ref = {"name": "fleet-signing", "key": "s"}
    assert router_env["PREFIXLB_ROUTER_REDIS_SIGNING_SECRET"]["valueFrom"]["secretKeyRef"] == ref
    init_env = {e["name"]: e for e in container(find(docs, "StatefulSet", "-worker"), "signing-key")["env"]}
    assert init_env["PREFIXLB_REDIS_SIGNING_SECRET"]["valueFrom"]["secretKeyRef"] == ref
    for kind, component in (("Deployment", "router"), ("StatefulSet", "worker")):
        assert "checksum/signing" in find(render_chart({}), kind, f"-{component}")["spec"]["template"]["metadata"][
            "annotations"]


def test_signing_off_or_no_redis_renders_no_secret_key_or_init_container():
    for values in ({"redis": {"signing": {"enabled": False}}},
                   {"redis": {"enabled": False}, "discovery": {"mode": "static"}}):
        docs = render_chart(values)
        assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == SECRET_NAME]
        worker, router = find(docs, "StatefulSet", "-worker"), find(docs, "Deployment", "-router")
        assert "initContainers" not in worker["spec"]["template"]["spec"]
        assert "PREFIXLB_WORKER_REDIS_SIGNING_KEY_FILE" not in pod_env(docs, worker, "worker")
        assert "PREFIXLB_ROUTER_REDIS_SIGNING_SECRET" not in pod_env(docs, router, "router")
