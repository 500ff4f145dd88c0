"""The Helm chart (helm/prefixlb), rendered offline by the real Helm library.

Every rendered manifest is validated against the Kubernetes JSON schemas (kubernetes-validate,
strict: unknown fields are errors), the chart is linted, and the values an operator sets are
followed into the containers: into the flags (which must be flags the commands accept, and
must parse into the settings the operator meant), the probes, the Secret, the GPU request.
"""
from __future__ import annotations

import base64
import json

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy_support import (
    CHART, command_flags, container, expand_pod_env, find, flags_used, load_router_config,
    load_server_config, pod_env, render_chart,
)
from tests.support import ROOT

KUBE_VERSION = "1.30.0"  # the chart's minimum (Chart.yaml kubeVersion)
# Custom resources kubernetes-validate has no schema for; their fields are checked by hand below.
CRD_KINDS = {("gateway.networking.k8s.io/v1", "HTTPRoute"),
             ("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule")}

EVERYTHING_ON = {
    "discovery": {"mode": "kubernetes"},
    "router": {
        "affinity": 0.35, "policy": "consistent_hash", "replicas": 3,
        "autoscaling": {"enabled": False},
        "ingress": {"enabled": True, "className": "nginx",
                    "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]},
        "httpRoute": {"enabled": True, "hostnames": ["llm.example.com"]},
        "extraWorkers": ["http://vllm-0.inference.svc:8000"],
        "workers": [{"url": "http://vllm-1.inference.svc:8000", "kind": "vllm",
                     "kvEvents": "tcp://vllm-1.inference.svc:5557", "kvReplay": "tcp://vllm-1.inference.svc:5558"}],
        "tokenizers": [{"model": "llama", "path": "/models/llama"}],
        "workerAllow": ["10.244.0.0/16:8000"],
        "apiKeys": {"keys": ["client-key-1", "client-key-2"]},
        "prewarm": {"top": 16},
        "limits": {"maxInflight": 512, "maxQueue": 64},
    },
    "worker": {"replicas": 4, "gpu": {"count": 2}, "model": "/models/llama",
               "modelVolume": {"enabled": True, "existingClaim": "llama-weights"},
               "apiKey": {"enabled": True}},
    "vllm": {"enabled": True, "model": "/models/llama", "servedModelName": "llama",
             "modelVolume": {"enabled": True, "existingClaim": "llama-weights"}},
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                "grafanaDashboard": {"enabled": True}},
    "networkPolicy": {"enabled": True},
}
VALUE_SETS = {
    "defaults": {},
    "everything-on": EVERYTHING_ON,
    "static-external-redis": {"discovery": {"mode": "static"},
                              "redis": {"enabled": False, "url": "redis://cache.example:6379/2"}},
    "simulated-cpu-fleet": {"worker": {"simulate": {"enabled": True, "gpu": "H200", "timeScale": 10},
                                       "gpu": {"count": 0}, "replicas": 16}},
    "no-redis-routers-only": {"redis": {"enabled": False}, "discovery": {"mode": "static"},
                              "worker": {"enabled": False},
                              "router": {"extraWorkers": ["http://10.0.0.5:8000"]}},
}


def _router_args(docs: list[dict]) -> list[str]:
    return container(find(docs, "Deployment", "-router"), "router")["args"]


def _worker_args(docs: list[dict]) -> list[str]:
    return expand_pod_env(container(find(docs, "StatefulSet", "-worker"), "worker")["args"])


def _secret_env(docs: list[dict], workload: dict, name: str) -> dict[str, str]:
    """The container's env variables that come from Secrets the chart renders, decoded."""
    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    env = {}
    for e in container(workload, name).get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["name"] in secrets:
            env[e["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    return env


def _secret_refs(workload: dict, name: str) -> dict[str, dict]:
    """{env variable: secretKeyRef} of a container."""
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(workload, name).get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def _pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append((d["metadata"]["name"], d["spec"]))
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render_chart(values) for name, values in VALUE_SETS.items()}


def test_chart_lints_without_warnings_for_default_and_non_default_values():
    for values in (None, EVERYTHING_ON):
        report = helm.lint(CHART, values, kube_version="v" + KUBE_VERSION)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], (report["errors"], problems)


@pytest.mark.parametrize("kube_version", [KUBE_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_manifest_is_valid_against_the_kubernetes_schemas(rendered, value_set, kube_version):
    docs = rendered[value_set]
    assert docs, "the chart rendered nothing"
    for doc in docs:
        obj = {k: v for k, v in doc.items() if k != "_template"}
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['_template']}: {obj['kind']} {obj['metadata']['name']}: {exc}")


def test_default_install_is_routers_workers_and_redis_with_ha_objects(rendered):
    docs = rendered["defaults"]
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("Deployment", "demo-prefixlb-router"),
        ("HorizontalPodAutoscaler", "demo-prefixlb-router"),
        ("NetworkPolicy", "demo-prefixlb-redis"),
        ("NetworkPolicy", "demo-prefixlb-router"),
        ("NetworkPolicy", "demo-prefixlb-worker"),
        ("PodDisruptionBudget", "demo-prefixlb-router"),
        ("PodDisruptionBudget", "demo-prefixlb-worker"),
        ("Pod", "demo-prefixlb-router-test"),
        ("Secret", "demo-prefixlb-admin-token"),
        ("Secret", "demo-prefixlb-redis"),
        ("Secret", "demo-prefixlb-signing"),
        ("Service", "demo-prefixlb-redis"),
        ("Service", "demo-prefixlb-router"),
        ("Service", "demo-prefixlb-worker-headless"),
        ("ServiceAccount", "demo-prefixlb-router"),
        ("StatefulSet", "demo-prefixlb-redis"),
        ("StatefulSet", "demo-prefixlb-worker"),
    ])
    hpa = find(docs, "HorizontalPodAutoscaler", "-router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "demo-prefixlb-router"}
    assert hpa["spec"]["minReplicas"] >= 2
    # With the HPA in charge, the Deployment leaves the replica count to it.
    assert "replicas" not in find(docs, "Deployment", "-router")["spec"]


def test_without_autoscaling_the_router_deployment_runs_the_configured_replicas(rendered):
    assert find(rendered["everything-on"], "Deployment", "-router")["spec"]["replicas"] == 3
    assert not [d for d in rendered["everything-on"] if d["kind"] == "HorizontalPodAutoscaler"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_router_args_are_flags_prefixlb_router_accepts(rendered, value_set):
    args = _router_args(rendered[value_set])
    unknown = sorted(set(flags_used(args)) - command_flags("router"))
    assert unknown == [], f"flags `prefixlb router --help` does not list: {unknown}"
    load_router_config(args)  # and the real loader accepts every value


@pytest.mark.parametrize("value_set", sorted(v for v in VALUE_SETS if v != "no-redis-routers-only"))
def test_worker_args_are_flags_prefixlb_worker_accepts(rendered, value_set):
    args = _worker_args(rendered[value_set])
    unknown = sorted(set(flags_used(args)) - command_flags("worker"))
    assert unknown == [], f"flags `prefixlb worker --help` does not list: {unknown}"
    load_server_config(args)


def test_router_knobs_in_values_reach_the_routers_settings():
    values = {"router": {"affinity": 0.35, "policy": "least_load"}}
    cfg = load_router_config(_router_args(render_chart(values)))
    assert cfg.affinity == 0.35
    assert cfg.policy == "least_load"


def test_every_router_knob_in_values_reaches_the_routers_settings():
    values = {"chunkSize": 256, "router": {
        "sessionHeaders": ["x-conversation"], "sessionFields": ["user"],
        "index": {"maxEntries": 50000, "optimisticTtlSeconds": 12.5, "confirmedTtlSeconds": 900},
        "limits": {"maxInflightPerWorker": 48, "maxBodyBytes": 1048576, "maxAttempts": 3,
                   "connectTimeoutSeconds": 1.5, "readTimeoutSeconds": 120},
        "health": {"intervalSeconds": 1, "timeoutSeconds": 0.5, "unhealthyAfter": 4},
        "logLevel": "debug", "logFormat": "json", "extraArgs": ["--tie-tolerance=0.1"]}}
    cfg = load_router_config(_router_args(render_chart(values)))
    assert (cfg.session_headers, cfg.session_fields, cfg.chunk_size) == (["x-conversation"], ["user"], 256)
    assert (cfg.index_max_entries, cfg.index_optimistic_ttl, cfg.index_confirmed_ttl) == (50000, 12.5, 900.0)
    assert (cfg.max_inflight_per_worker, cfg.max_body_bytes, cfg.max_attempts) == (48, 1048576, 3)
    assert (cfg.connect_timeout, cfg.read_timeout) == (1.5, 120.0)
    assert (cfg.health_interval, cfg.health_timeout, cfg.unhealthy_after) == (1.0, 0.5, 4)
    assert (cfg.log_level, cfg.log_format, cfg.tie_tolerance) == ("debug", "json", 0.1)


def test_failure_handling_knobs_in_values_reach_the_routers_settings():
    values = {"router": {
        "limits": {"maxInflight": 512, "maxQueue": 32, "maxQueueBytes": 8388608, "queueTimeoutSeconds": 2.5,
                   "bodyTimeoutSeconds": 10, "retryDeadlineSeconds": 12},
        "health": {"jitter": 0.1, "breakerCoolDownSeconds": 2, "breakerMaxCoolDownSeconds": 60,
                   "halfOpenSuccesses": 5, "halfOpenMaxInflight": 1, "registryGraceSeconds": 20},
        "prewarm": {"top": 16, "maxBytes": 65536, "timeoutSeconds": 45}}}
    cfg = load_router_config(_router_args(render_chart(values)))
    assert (cfg.max_inflight, cfg.max_queue, cfg.max_queue_bytes, cfg.queue_timeout) == (512, 32, 8388608, 2.5)
    assert (cfg.body_timeout, cfg.retry_deadline) == (10.0, 12.0)
    assert (cfg.health_jitter, cfg.breaker_cool_down, cfg.breaker_max_cool_down) == (0.1, 2.0, 60.0)
    assert (cfg.half_open_successes, cfg.half_open_max_inflight, cfg.registry_grace) == (5, 1, 20.0)
    assert (cfg.prewarm_top, cfg.prewarm_max_bytes, cfg.prewarm_timeout) == (16, 65536, 45.0)


def test_the_routers_body_limit_is_the_workers_body_limit_too():
    cfg = load_server_config(_worker_args(render_chart({"router": {"limits": {"maxBodyBytes": 1048576}}})))
    assert cfg.max_body_bytes == 1048576


def test_null_router_knobs_leave_the_routers_own_defaults():
    from router.config import RouterConfig

    cfg = load_router_config(_router_args(render_chart({})))
    defaults = RouterConfig()
    for name in ("affinity", "session_headers", "index_max_entries", "max_inflight_per_worker",
                 "read_timeout", "chunk_size", "health_interval", "max_inflight", "max_queue",
                 "max_queue_bytes", "queue_timeout", "retry_deadline", "breaker_cool_down",
                 "registry_grace", "prewarm_top", "worker_allow", "api_keys", "worker_api_key"):
        assert getattr(cfg, name) == getattr(defaults, name), name
    assert (cfg.prewarm_top, cfg.worker_allow, cfg.api_keys, cfg.worker_api_key) == (0, [], [], None)


def test_every_worker_knob_in_values_reaches_the_workers_settings():
    values = {"chunkSize": 256, "worker": {
        "model": "small", "servedModelName": "assistant", "kvBlocks": 4096, "blockSize": 32,
        "maxNumSeqs": 16, "maxNumBatchedTokens": 4096, "maxModelLen": 8192,
        "attentionBackend": "triton", "logLevel": "warning", "drainTimeoutSeconds": 90,
        "dtype": "bfloat16", "gpuMemoryUtilization": 0.85, "logFormat": "json", "extraArgs": ["--seed=7"]}}
    cfg = load_server_config(_worker_args(render_chart(values)))
    assert (cfg.model, cfg.served_model_name, cfg.kv_blocks, cfg.block_size) == ("small", "assistant", 4096, 32)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (16, 4096, 8192)
    assert (cfg.attention_backend, cfg.chunk_size, cfg.log_level) == ("triton", 256, "warning")
    assert (cfg.drain_timeout, cfg.seed) == (90.0, 7)
    assert (cfg.dtype, cfg.gpu_memory_utilization, cfg.log_format) == ("bfloat16", 0.85, "json")


def test_by_default_a_gpu_worker_sizes_its_kv_cache_from_the_gpus_memory_in_the_checkpoints_dtype():
    cfg = load_server_config(_worker_args(render_chart({})))
    assert (cfg.kv_memory, cfg.kv_blocks, cfg.device) == (None, None, "cuda")
    assert (cfg.dtype, cfg.gpu_memory_utilization) == ("auto", 0.9)


def test_kubernetes_discovery_watches_this_releases_worker_pods():
    docs = render_chart({"discovery": {"mode": "kubernetes"}})
    cfg = load_router_config(_router_args(docs))
    pod_labels = find(docs, "StatefulSet", "-worker")["spec"]["template"]["metadata"]["labels"]
    selector = dict(term.split("=") for term in cfg.k8s_selector.split(","))
    assert selector.items() <= pod_labels.items()
    assert selector == {"app.kubernetes.io/name": "prefixlb", "app.kubernetes.io/instance": "demo",
                        "app.kubernetes.io/component": "worker"}
    assert (cfg.k8s_namespace, cfg.k8s_port) == ("llm", 8000)
    assert cfg.redis is None  # the bundled Redis's URL carries a password: it comes from the env
    env = pod_env(docs, find(docs, "Deployment", "-router"), "router")
    cfg = load_router_config(_router_args(docs), environ=env)
    assert cfg.redis is not None  # load reports and KV events still flow through Redis


def test_routers_and_workers_share_the_bundled_redis_under_one_key_prefix():
    docs = render_chart({"redis": {"keyPrefix": "team-a:"}})
    router = load_router_config(_router_args(docs), environ=pod_env(docs, find(docs, "Deployment", "-router"), "router"))
    worker = load_server_config(_worker_args(docs), environ=pod_env(docs, find(docs, "StatefulSet", "-worker"), "worker"))
    service = find(docs, "Service", "-redis")
    address = f"@{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    assert router.redis.endswith(address) and worker.redis.endswith(address)
    assert router.redis_prefix == worker.redis_prefix == "team-a:"


def test_workers_register_under_their_pod_name_and_advertise_their_pod_ip(rendered):
    cfg = load_server_config(_worker_args(rendered["defaults"]))
    assert cfg.worker_id == "demo-prefixlb-worker-0"
    assert cfg.advertise == "http://10.1.2.3:8000"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
           for e in container(find(rendered["defaults"], "StatefulSet", "-worker"), "worker")["env"]
           if "fieldRef" in e.get("valueFrom", {})}
    assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}


@pytest.mark.parametrize("component,kind", [("router", "Deployment"), ("worker", "StatefulSet")])
def test_probes_hit_the_port_the_app_listens_on(rendered, component, kind):
    docs = rendered["defaults"]
    c = container(find(docs, kind, f"-{component}"), component)
    args = _router_args(docs) if component == "router" else _worker_args(docs)
    cfg = load_router_config(args) if component == "router" else load_server_config(args)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # The router's admin API has a port of its own, outside the Service.
    assert ports == ({"http": cfg.port, "admin": cfg.admin_port} if component == "router" else {"http": cfg.port})
    assert cfg.host == "0.0.0.0"
    # the router is ready only while it can route (/ready); alive while it answers (/health)
    ready = "/ready" if component == "router" else "/health"
    assert c["readinessProbe"]["httpGet"] == {"path": ready, "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    service = find(docs, "Service", f"-{component}" if component == "router" else "-worker-headless")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_admin_token_comes_from_a_generated_secret_by_default(rendered):
    docs = rendered["defaults"]
    env = {e["name"]: e for e in container(find(docs, "Deployment", "-router"), "router")["env"]}
    ref = env["PREFIXLB_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = find(docs, "Secret", "-admin-token")
    assert ref == {"name": secret["metadata"]["name"], "key": "token"}
    assert len(base64.b64decode(secret["data"]["token"])) == 40
    assert "value" not in env["PREFIXLB_ROUTER_ADMIN_TOKEN"]


def test_admin_token_from_an_existing_secret_renders_no_secret_of_its_own():
    docs = render_chart({"router": {"adminToken": {"existingSecret": "ops-token", "secretKey": "bearer"}}})
    env = {e["name"]: e for e in container(find(docs, "Deployment", "-router"), "router")["env"]}
    assert env["PREFIXLB_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ops-token", "key": "bearer"}
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == ["demo-prefixlb-redis", "demo-prefixlb-signing"]


def test_admin_token_env_variable_is_the_routers_admin_token_setting():
    cfg = load_router_config([], environ={"PREFIXLB_ROUTER_ADMIN_TOKEN": "s3cret"})
    assert cfg.admin_token == "s3cret"


def test_worker_allow_list_reaches_the_router_and_admits_the_workers_the_chart_names_itself():
    from router.fleet.worker_url import InvalidWorkerURL, WorkerURLPolicy

    values = {"discovery": {"mode": "static"},
              "router": {"workerAllow": ["10.244.0.0/16:8000"], "extraWorkers": ["http://vllm-0.inference.svc:8000"]}}
    cfg = load_router_config(_router_args(render_chart(values)))
    assert cfg.worker_allow == ["10.244.0.0/16:8000", "*.demo-prefixlb-worker-headless.llm.svc:8000",
                                "vllm-0.inference.svc:8000"]
    policy = WorkerURLPolicy(cfg.worker_allow)
    for url in cfg.workers:  # the static worker DNS names and the extra worker
        assert policy.check(url) == url
    assert policy.check("http://10.244.3.7:8000") == "http://10.244.3.7:8000"  # a pod IP registering in Redis
    for outside in ("http://169.254.169.254", "http://10.244.3.7:9000", "http://vllm-0.inference.svc:9000",
                    "http://evil.example.com:8000"):
        with pytest.raises(InvalidWorkerURL):
            policy.check(outside)


def test_without_an_allow_list_the_router_gets_no_worker_allow_flag(rendered):
    assert "--worker-allow" not in flags_used(_router_args(rendered["static-external-redis"]))


def test_client_api_keys_reach_the_router_from_a_secret_never_as_arguments():
    docs = render_chart({"router": {"apiKeys": {"keys": ["key-a", "key-b"]}}})
    router = find(docs, "Deployment", "-router")
    args = _router_args(docs)
    env = _secret_env(docs, router, "router")
    assert env["PREFIXLB_ROUTER_API_KEYS"] == "key-a,key-b"
    assert not [a for a in args if "key-a" in a]
    cfg = load_router_config(args, environ=env)
    assert cfg.api_keys == ["key-a", "key-b"]
    assert cfg.worker_api_key is None  # the workers stay open unless worker.apiKey is on
    # `helm test` is a client too: it sends the first key.
    test_pod = find(docs, "Pod", "-router-test")
    assert _secret_env(docs, test_pod, "check") == {"PREFIXLB_API_KEYS": "key-a,key-b"}


def test_client_api_keys_from_an_existing_secret_render_no_secret_of_their_own():
    docs = render_chart({"router": {"apiKeys": {"existingSecret": "client-keys", "secretKey": "keys"}}})
    assert _secret_refs(find(docs, "Deployment", "-router"), "router")["PREFIXLB_ROUTER_API_KEYS"] == {
        "name": "client-keys", "key": "keys"}
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-keys")]


def test_the_routers_are_open_and_carry_no_api_key_by_default(rendered):
    for kind, name in (("Deployment", "router"), ("StatefulSet", "worker")):
        refs = _secret_refs(find(rendered["defaults"], kind, f"-{name}"), name)
        assert not [v for v in refs if "API_KEY" in v], (name, refs)


def test_worker_api_key_is_generated_once_and_shared_by_routers_and_workers():
    docs = render_chart({"worker": {"apiKey": {"enabled": True}}})
    router, worker = find(docs, "Deployment", "-router"), find(docs, "StatefulSet", "-worker")
    router_env, worker_env = _secret_env(docs, router, "router"), _secret_env(docs, worker, "worker")
    key = router_env["PREFIXLB_ROUTER_WORKER_API_KEY"]
    assert len(key) == 40 and key.isalnum()
    assert load_router_config(_router_args(docs), environ=router_env).worker_api_key == key
    assert load_server_config(_worker_args(docs), environ=worker_env).api_keys == [key]
    assert key not in json.dumps(router["spec"]) and key not in json.dumps(worker["spec"])
    # A changed key rolls both sides.
    for workload in (router, worker):
        assert workload["spec"]["template"]["metadata"]["annotations"]["checksum/api-keys"]


def test_worker_api_key_from_an_existing_secret_reaches_routers_in_front_of_outside_workers():
    values = {"worker": {"enabled": False, "apiKey": {"enabled": True, "existingSecret": "fleet-key",
                                                      "secretKey": "key"}},
              "redis": {"enabled": False}, "discovery": {"mode": "static"},
              "router": {"extraWorkers": ["http://10.0.0.5:8000"]}}
    docs = render_chart(values)
    assert _secret_refs(find(docs, "Deployment", "-router"), "router")["PREFIXLB_ROUTER_WORKER_API_KEY"] == {
        "name": "fleet-key", "key": "key"}
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-keys")]


def test_workers_request_the_configured_gpus_and_run_the_engine_on_cuda(rendered):
    docs = rendered["everything-on"]
    c = container(find(docs, "StatefulSet", "-worker"), "worker")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    cfg = load_server_config(_worker_args(docs))
    assert cfg.device == "cuda"
    assert cfg.model == "/models/llama"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    volumes = {v["name"]: v for v in find(docs, "StatefulSet", "-worker")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}


def test_simulated_workers_request_no_gpu_and_run_the_latency_model(rendered):
    docs = rendered["simulated-cpu-fleet"]
    c = container(find(docs, "StatefulSet", "-worker"), "worker")
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    cfg = load_server_config(_worker_args(docs))
    assert (cfg.simulate, cfg.gpu, cfg.time_scale) == (True, "H200", 10.0)
    assert find(docs, "StatefulSet", "-worker")["spec"]["replicas"] == 16


def test_workers_drain_within_their_termination_grace_period(rendered):
    docs = rendered["defaults"]
    pod = find(docs, "StatefulSet", "-worker")["spec"]["template"]["spec"]
    cfg = load_server_config(_worker_args(docs))
    # SIGTERM -> drain -> exit must finish before the kubelet's SIGKILL.
    assert 0 < cfg.drain_timeout < pod["terminationGracePeriodSeconds"]


def test_every_container_runs_as_non_root_with_a_read_only_root_filesystem(rendered):
    for value_set, docs in rendered.items():
        for name, pod in _pod_specs(docs):
            for c in pod["containers"]:
                sc = c["securityContext"]
                non_root = sc.get("runAsNonRoot", pod.get("securityContext", {}).get("runAsNonRoot"))
                assert non_root is True, (value_set, name, c["name"])
                assert sc["readOnlyRootFilesystem"] is True, (value_set, name, c["name"])
                assert sc["allowPrivilegeEscalation"] is False, (value_set, name, c["name"])
                assert sc["capabilities"] == {"drop": ["ALL"]}, (value_set, name, c["name"])
            # A read-only root needs a writable /tmp for Python, Triton and torch caches.
            if name.endswith(("-router", "-worker")):
                mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
                assert "/tmp" in mounts, (value_set, name)


def test_optional_ingress_and_httproute_send_traffic_to_the_router_service(rendered):
    docs = rendered["everything-on"]
    service = find(docs, "Service", "-router")
    ingress = find(docs, "Ingress", "-router")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    route = find(docs, "HTTPRoute", "-router")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    rule = route["spec"]["rules"][0]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]
    assert rule["timeouts"] == {"request": "600s"}
    for absent in ("Ingress", "HTTPRoute"):
        assert not [d for d in rendered["defaults"] if d["kind"] == absent]


def test_service_monitors_scrape_metrics_under_the_job_names_the_alerts_use(rendered):
    docs = rendered["everything-on"]
    for component in ("router", "worker"):
        sm = find(docs, "ServiceMonitor", f"-{component}")
        endpoint = sm["spec"]["endpoints"][0]
        assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
        assert {"targetLabel": "job", "replacement": f"prefixlb-{component}"} in endpoint["relabelings"]
        selected = sm["spec"]["selector"]["matchLabels"]
        services = [d for d in docs if d["kind"] == "Service"
                    and selected.items() <= d["metadata"]["labels"].items()]
        assert len(services) == 1 and services[0]["spec"]["ports"][0]["name"] == "http"


def test_kubernetes_discovery_gets_a_read_only_role_bound_to_the_routers_account(rendered):
    docs = rendered["everything-on"]
    role = find(docs, "Role", "-discovery")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = find(docs, "RoleBinding", "-discovery")
    pod = find(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "llm"}]
    assert pod["automountServiceAccountToken"] is True
    # In the default (Redis) mode routers hold no API credentials at all.
    default_pod = find(rendered["defaults"], "Deployment", "-router")["spec"]["template"]["spec"]
    assert default_pod["automountServiceAccountToken"] is False
    assert not [d for d in rendered["defaults"] if d["kind"] in ("Role", "RoleBinding")]


def test_static_discovery_lists_every_worker_pod_by_its_stable_dns_name(rendered):
    args = _router_args(rendered["static-external-redis"])
    cfg = load_router_config(args)
    assert cfg.workers == [f"http://demo-prefixlb-worker-{i}.demo-prefixlb-worker-headless.llm.svc:8000"
                           for i in range(2)]
    assert cfg.redis == "redis://cache.example:6379/2"
    assert not [d for d in rendered["static-external-redis"] if d["metadata"]["name"].endswith("-redis")]


def test_external_redis_url_can_come_from_a_secret():
    docs = render_chart({"redis": {"enabled": False, "existingSecret": "redis-creds"}})
    for kind, name in (("Deployment", "router"), ("StatefulSet", "worker")):
        env = {e["name"]: e for e in container(find(docs, kind, f"-{name}"), name)["env"]}
        ref = env[f"PREFIXLB_{name.upper()}_REDIS"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "redis-creds", "key": "url"}


def test_prometheus_rule_and_dashboard_carry_the_files_in_deploy(rendered):
    docs = rendered["everything-on"]
    rule = find(docs, "PrometheusRule")
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    cm = find(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/prefixlb.json").read_text())
    assert json.loads(cm["data"]["prefixlb-dashboard.json"]) == dashboard


def test_prometheus_rule_runbook_urls_become_links_under_a_base_url():
    base = "https://git.example.com/prefixlb/blob/v0.1.0/"
    docs = render_chart({"metrics": {"prometheusRule": {"enabled": True, "runbookBaseUrl": base}}})
    rendered = {r["alert"]: r["annotations"]["runbook_url"]
                for g in find(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    expected = {r["alert"]: base + r["annotations"]["runbook_url"] for g in alerts["groups"] for r in g["rules"]}
    assert rendered == expected
    assert rendered["PrefixlbWorkerDown"] == base + "docs/operations.md#7-failure-modes"


def test_network_policy_admits_only_routers_to_workers(rendered):
    policy = find(rendered["everything-on"], "NetworkPolicy", "-worker")
    sources = policy["spec"]["ingress"][0]["from"]
    assert sources == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prefixlb", "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "router"}}}]


@pytest.mark.parametrize("values,message", [
    ({"discovery": {"mode": "dns"}}, "discovery"),
    ({"router": {"affinity": 1.5}}, "affinity"),
    ({"router": {"policy": "random"}}, "policy"),
    ({"worker": {"modelVolume": {"enabled": True}}}, "modelVolume"),
    ({"redis": {"enabled": False}}, "discovery.mode=redis needs a Redis"),
    ({"router": {"limits": {"maxQueue": -1}}}, "/router/limits/maxQueue"),
    ({"router": {"prewarm": {"top": 5000}}}, "/router/prewarm/top"),
    ({"router": {"workerAllow": ["http://10.0.0.5/"]}}, "/router/workerAllow/0"),
    ({"router": {"apiKeys": {"keys": ["a,b"]}}}, "/router/apiKeys/keys/0"),
    ({"worker": {"apiKey": {"enabled": True, "value": "two words"}}}, "/worker/apiKey/value"),
    ({"worker": {"enabled": False, "apiKey": {"enabled": True}}}, "worker.apiKey: with worker.enabled=false"),
    ({"router": {"adminPort": 8000}}, "router.adminPort must differ from router.port"),
    ({"worker": {"dtype": "fp16"}}, "/worker/dtype"),
    ({"worker": {"gpuMemoryUtilization": 1.5}}, "/worker/gpuMemoryUtilization"),
])
def test_invalid_values_fail_the_install_with_a_message_naming_the_value(values, message):
    with pytest.raises(helm.HelmError) as exc:
        render_chart(values)
    assert message in str(exc.value)
