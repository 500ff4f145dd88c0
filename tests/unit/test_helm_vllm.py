"""The Helm chart in front of vLLM: workers of a given kind, the chart's own vLLM servers, tokenizers.

Operators name workers outside the chart with their kind and KV-event sockets
(``router.workers``), or let the chart run unmodified vLLM servers (``vllm``): every router then
lists each vLLM pod by its stable DNS name as ``vllm=URL,kv-events=...,kv-replay=...``, and those
names, ports and sockets must be the ones the pods and their headless Service really have. The
vLLM flags are parsed by vLLM's own parser (from ``.venv-vllm``, when installed), the router's
by the router's loader and worker-spec parser (router/fleet/backends.py).
"""
from __future__ import annotations

import json

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy_support import (
    CHART, command_flags, container, find, flags_used, load_router_config, render_chart, vllm_server_settings,
)

KUBE_VERSION = "1.30.0"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
OUTSIDE = {"url": "http://vllm-a.inference.svc:8000", "kind": "vllm",
           "kvEvents": "tcp://vllm-a.inference.svc:5557", "kvReplay": "tcp://vllm-a-replay.inference.svc:5558"}
VLLM = {
    "vllm": {"enabled": True, "model": MODEL, "replicas": 3, "gpuMemoryUtilization": 0.9, "maxModelLen": 8192,
             "tensorParallelSize": 2, "gpu": {"count": 2}, "extraArgs": ["--max-num-seqs=128"]},
    "router": {"workers": [OUTSIDE, {"url": "http://sglang-0.inference.svc:30000", "kind": "sglang"},
                           {"url": "http://10.0.0.9:8000"}],
               "tokenizers": [{"model": MODEL, "path": "/tokenizers/llama"}],
               "extraVolumes": [{"name": "tokenizers", "persistentVolumeClaim": {"claimName": "tokenizers"}}],
               "extraVolumeMounts": [{"name": "tokenizers", "mountPath": "/tokenizers", "readOnly": True}]},
}
VLLM_ONLY = {"worker": {"enabled": False}, "redis": {"enabled": False}, "discovery": {"mode": "static"},
             "vllm": {"enabled": True, "model": "/models/qwen", "servedModelName": "qwen",
                      "modelVolume": {"enabled": True, "existingClaim": "qwen-weights"}},
             "router": {"tokenizers": [{"model": "qwen", "path": "/models/qwen"}], "workerAllow": ["10.0.0.0/8"]}}


def _router_args(docs: list[dict]) -> list[str]:
    return container(find(docs, "Deployment", "-router"), "router")["args"]


def _vllm(docs: list[dict]) -> dict:
    return container(find(docs, "StatefulSet", "-vllm"), "vllm")


def _specs(args: list[str]):
    from router.fleet.backends import parse_worker_spec

    return [parse_worker_spec(a.split("=", 1)[1]) for a in args if a.startswith("--worker=")]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render_chart(VLLM)


@pytest.mark.parametrize("kube_version", [KUBE_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("values", [VLLM, VLLM_ONLY], ids=["beside-workers", "vllm-only"])
def test_manifests_with_vllm_servers_are_valid_against_the_kubernetes_schemas(values, kube_version):
    for doc in render_chart(values):
        obj = {k: v for k, v in doc.items() if k != "_template"}
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['_template']}: {obj['kind']} {obj['metadata']['name']}: {exc}")


def test_chart_with_vllm_servers_lints_without_warnings():
    report = helm.lint(CHART, VLLM, kube_version="v" + KUBE_VERSION)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], (report["errors"], problems)


def test_vllm_servers_are_a_statefulset_with_a_headless_service_and_a_pdb(rendered):
    names = sorted((d["kind"], d["metadata"]["name"]) for d in rendered if "-vllm" in d["metadata"]["name"])
    assert names == [("NetworkPolicy", "demo-prefixlb-vllm"), ("PodDisruptionBudget", "demo-prefixlb-vllm"),
                     ("Service", "demo-prefixlb-vllm-headless"), ("StatefulSet", "demo-prefixlb-vllm")]
    sts = find(rendered, "StatefulSet", "-vllm")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == "demo-prefixlb-vllm-headless"
    assert _vllm(rendered)["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert not [d for d in render_chart({}) if "-vllm" in d["metadata"]["name"]]  # off by default


def test_the_router_lists_every_vllm_pod_with_kind_vllm_and_its_kv_event_sockets(rendered):
    cfg = load_router_config(_router_args(rendered))
    specs = [s for s in _specs(_router_args(rendered)) if "demo-prefixlb-vllm" in s.url]
    service = find(rendered, "Service", "-vllm-headless")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    pod_labels = find(rendered, "StatefulSet", "-vllm")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    hosts = [f"demo-prefixlb-vllm-{i}.demo-prefixlb-vllm-headless.llm.svc" for i in range(3)]
    assert [(s.kind, s.url, s.kv_events, s.kv_replay) for s in specs] == [
        ("vllm", f"http://{h}:{ports['http']}", f"tcp://{h}:{ports['kv-events']}", f"tcp://{h}:{ports['kv-replay']}")
        for h in hosts]
    assert [str(s) for s in specs] == [w for w in cfg.workers if "demo-prefixlb-vllm" in w]
    # Every Service port leads to the container port of the same name.
    container_ports = {p["name"]: p["containerPort"] for p in _vllm(rendered)["ports"]}
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {n: n for n in container_ports}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == container_ports


def test_vllm_servers_run_with_the_flags_the_router_needs(rendered):
    from router.fleet.kv_subscriber import DEFAULT_TOPIC

    c = _vllm(rendered)
    assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = c["args"]
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(args)
    assert args[-1] == "--max-num-seqs=128"  # extraArgs last, verbatim
    kv = json.loads(next(a for a in args if a.startswith("--kv-events-config=")).split("=", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert kv == {"enable_kv_cache_events": True, "publisher": "zmq", "topic": DEFAULT_TOPIC,
                  "endpoint": f"tcp://*:{ports['kv-events']}", "replay_endpoint": f"tcp://*:{ports['kv-replay']}"}
    parsed = vllm_server_settings(args)
    if parsed is None:
        pytest.skip("no .venv-vllm (make vllm): vLLM's own parser not run")
    assert (parsed["model"], parsed["host"], parsed["port"]) == (MODEL, "0.0.0.0", ports["http"])
    assert parsed["enable_prefix_caching"] is True and parsed["enable_prompt_tokens_details"] is True
    assert {k: parsed["kv_events_config"][k] for k in kv} == kv


def test_workers_outside_the_chart_reach_the_router_with_their_kind_and_sockets(rendered):
    from router.config import check_router_config

    args = _router_args(rendered)
    cfg = load_router_config(args)
    check_router_config(cfg)  # what `prefixlb router` checks before it starts
    outside = [s for s in _specs(args) if "demo-prefixlb" not in s.url]
    assert [(s.url, s.kind, s.kv_events, s.kv_replay) for s in outside] == [
        (OUTSIDE["url"], "vllm", OUTSIDE["kvEvents"], OUTSIDE["kvReplay"]),
        ("http://sglang-0.inference.svc:30000", "sglang", None, None),
        ("http://10.0.0.9:8000", None, None, None)]
    assert cfg.tokenizers == [f"{MODEL}=/tokenizers/llama"]
    assert sorted(set(flags_used(args)) - command_flags("router")) == []


def test_tokenizer_directories_are_mounted_into_the_router_pods(rendered):
    mounts = {m["mountPath"] for m in container(find(rendered, "Deployment", "-router"), "router")["volumeMounts"]}
    for entry in load_router_config(_router_args(rendered)).tokenizers:
        path = entry.split("=", 1)[1]
        assert any(path == m or path.startswith(m + "/") for m in mounts), path


def test_the_allow_list_admits_the_vllm_pods_and_the_kv_event_hosts_it_names():
    from router.fleet.worker_url import InvalidWorkerURL, WorkerURLPolicy

    values = {**VLLM, "router": {**VLLM["router"], "workerAllow": ["10.0.0.0/8:8000"]}}
    specs = _specs(_router_args(render_chart(values)))
    policy = WorkerURLPolicy(load_router_config(_router_args(render_chart(values))).worker_allow)
    for spec in specs:
        assert policy.check(spec.url) == spec.url
        for endpoint in (spec.kv_events, spec.kv_replay):
            if endpoint:
                policy.check_host(endpoint.split("//")[1].rsplit(":", 1)[0])
    for outside in ("http://vllm-a.inference.svc:9000", "http://demo-prefixlb-vllm-0.elsewhere.svc:8000",
                    "http://169.254.169.254"):
        with pytest.raises(InvalidWorkerURL):
            policy.check(outside)
    with pytest.raises(InvalidWorkerURL):
        policy.check_host("kv.elsewhere.svc")


def test_a_vllm_only_fleet_needs_neither_redis_nor_prefixlb_workers():
    docs = render_chart(VLLM_ONLY)
    assert not [d for d in docs if d["metadata"]["name"].endswith(("-worker", "-redis", "-worker-headless"))]
    cfg = load_router_config(_router_args(docs))
    assert cfg.redis is None
    assert [s.kind for s in _specs(_router_args(docs))] == ["vllm", "vllm"]
    c = _vllm(docs)
    assert {m["name"]: m for m in c["volumeMounts"]}["models"] == {"name": "models", "mountPath": "/models",
                                                                  "readOnly": True}
    assert "--served-model-name=qwen" in c["args"] and cfg.tokenizers == ["qwen=/models/qwen"]


def test_without_kv_events_the_servers_publish_nothing_and_the_routers_subscribe_to_nothing():
    docs = render_chart({"vllm": {"enabled": True, "model": MODEL, "kvEvents": {"enabled": False}}})
    assert not [a for a in _vllm(docs)["args"] if a.startswith("--kv-events-config")]
    assert [p["name"] for p in find(docs, "Service", "-vllm-headless")["spec"]["ports"]] == ["http"]
    assert [(s.kind, s.kv_events) for s in _specs(_router_args(docs))] == [("vllm", None), ("vllm", None)]


def test_vllm_runs_as_non_root_with_its_caches_in_the_writable_tmp_volume(rendered):
    c = _vllm(rendered)
    pod = find(rendered, "StatefulSet", "-vllm")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert all(env[name].startswith("/tmp") for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR",
                                                         "TORCHINDUCTOR_CACHE_DIR"))
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/dev/shm"}


def test_the_router_to_worker_key_is_required_by_the_vllm_servers_too():
    docs = render_chart({**VLLM, "worker": {"apiKey": {"enabled": True}}})
    router_ref = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(find(docs, "Deployment", "-router"),
                                                                              "router")["env"] if "valueFrom" in e}
    vllm_ref = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _vllm(docs)["env"] if "valueFrom" in e}
    assert vllm_ref["VLLM_API_KEY"] == router_ref["PREFIXLB_ROUTER_WORKER_API_KEY"]
    # A generated key is fine for a fleet of the chart's own vLLM servers only.
    assert render_chart({**VLLM_ONLY, "worker": {"enabled": False, "apiKey": {"enabled": True}}})


def test_network_policy_admits_only_routers_to_the_vllm_servers():
    docs = render_chart({**VLLM, "networkPolicy": {"enabled": True}})
    policy = find(docs, "NetworkPolicy", "-vllm")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm"
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prefixlb", "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "router"}}}]}]  # every port: the API and both KV-event sockets


@pytest.mark.parametrize("values,message", [
    ({"vllm": {"enabled": True}}, "vllm.model"),
    ({"vllm": {"enabled": True, "model": MODEL, "modelVolume": {"enabled": True}}}, "vllm.modelVolume"),
    ({"router": {"workers": [{"url": "http://a:8000", "kind": "tgi"}]}}, "/router/workers/0/kind"),
    ({"router": {"workers": [{"url": "http://a:8000", "kvReplay": "tcp://a:5558"}]}}, "/router/workers/0"),
    ({"router": {"workers": [{"url": "http://a:8000", "kind": "openai", "kvEvents": "tcp://a:5557"}]}},
     "/router/workers/0/kind"),
    ({"router": {"workers": [{"url": "http://a:8000", "kind": "vllm", "kvEvents": "tcp://*:5557"}]}},
     "/router/workers/0/kvEvents"),
    ({"router": {"workers": [{"url": "http://a:8000", "kvEvent": "tcp://a:5557"}]}},
     "additional properties 'kvEvent' not allowed"),
    ({"router": {"tokenizers": [{"model": "m"}]}}, "/router/tokenizers/0"),
    ({"router": {"tokenizers": [{"model": "m", "path": "tokenizers/m"}]}}, "/router/tokenizers/0/path"),
])
def test_invalid_vllm_and_worker_values_fail_the_install_naming_the_value(values, message):
    with pytest.raises(helm.HelmError) as exc:
        render_chart(values)
    assert message in str(exc.value)
