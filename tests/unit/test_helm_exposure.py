"""What the chart puts in front of the routers and into their pods, beyond the defaults.

The Ingress and the HTTPRoute expose only the OpenAI API (``/v1``) unless told otherwise, so the
admin API and the metrics stay inside the cluster; operators add volumes, mounts, init
containers, a PriorityClass and a RuntimeClass to the router and worker pods, and the result
is valid against the Kubernetes schemas.
"""
from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy_support import container, find, render_chart

ON = {"router": {"ingress": {"enabled": True}, "httpRoute": {"enabled": True}}}
POD_EXTRAS = {
    "router": {
        "extraVolumes": [{"name": "ca", "configMap": {"name": "corporate-ca"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corporate", "readOnly": True}],
        "initContainers": [{"name": "wait-for-dns", "image": "busybox:1.37", "command": ["nslookup", "redis"]}],
        "priorityClassName": "llm-ingress",
    },
    "worker": {
        "extraVolumes": [{"name": "weights", "emptyDir": {"sizeLimit": "40Gi"}}],
        "extraVolumeMounts": [{"name": "weights", "mountPath": "/weights"}],
        "initContainers": [{"name": "fetch-weights", "image": "registry.example.com/fetch:1.0",
                            "args": ["s3://models/llama", "/weights"],
                            "volumeMounts": [{"name": "weights", "mountPath": "/weights"}]}],
        "priorityClassName": "llm-serving",
        "runtimeClassName": "nvidia",
        "model": "/weights",
    },
}


def _ingress_paths(docs: list[dict]) -> list[tuple[str, str]]:
    ingress = find(docs, "Ingress", "-router")
    return [(p["path"], p["pathType"]) for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]


def _route_paths(docs: list[dict]) -> list[dict]:
    route = find(docs, "HTTPRoute", "-router")
    return [m["path"] for rule in route["spec"]["rules"] for m in rule["matches"]]


def test_ingress_and_httproute_expose_only_the_openai_api_by_default():
    docs = render_chart(ON)
    assert _ingress_paths(docs) == [("/v1", "Prefix")]
    assert _route_paths(docs) == [{"type": "PathPrefix", "value": "/v1"}]


def test_the_exposed_paths_are_configurable():
    docs = render_chart({"router": {
        "ingress": {"enabled": True, "hosts": [{"host": "llm.example.com", "paths": [
            {"path": "/v1", "pathType": "Prefix"}, {"path": "/health", "pathType": "Exact"}]}]},
        "httpRoute": {"enabled": True, "paths": [{"type": "PathPrefix", "value": "/v1"},
                                                 {"type": "Exact", "value": "/health"}]}}})
    assert _ingress_paths(docs) == [("/v1", "Prefix"), ("/health", "Exact")]
    assert _route_paths(docs) == [{"type": "PathPrefix", "value": "/v1"}, {"type": "Exact", "value": "/health"}]


@pytest.mark.parametrize("values,where", [
    ({"router": {"httpRoute": {"paths": []}}}, "/router/httpRoute/paths"),
    ({"router": {"httpRoute": {"paths": [{"type": "PathPrefix", "value": "v1"}]}}}, "/router/httpRoute/paths/0/value"),
    ({"router": {"ingress": {"hosts": [{"host": "a.example.com", "paths": [{"path": "/v1", "pathType": "prefix"}]}]}}},
     "/router/ingress/hosts/0/paths/0/pathType"),
])
def test_an_empty_or_malformed_path_list_fails_the_install(values, where):
    import helm_python as helm

    with pytest.raises(helm.HelmError) as exc:
        render_chart(values)
    assert f"at '{where}'" in str(exc.value)


@pytest.mark.parametrize("component,kind", [("router", "Deployment"), ("worker", "StatefulSet")])
def test_pod_extras_reach_the_pod_spec(component, kind):
    extras = POD_EXTRAS[component]
    pod = find(render_chart(POD_EXTRAS), kind, f"-{component}")["spec"]["template"]["spec"]
    # A worker pod's own first init container derives its Redis signing key (test_helm_signing.py).
    own = ["signing-key"] if component == "worker" else []
    assert [c["name"] for c in pod["initContainers"][:len(own)]] == own
    assert pod["initContainers"][len(own):] == extras["initContainers"]
    assert pod["priorityClassName"] == extras["priorityClassName"]
    assert pod.get("runtimeClassName") == extras.get("runtimeClassName")
    # Added after the chart's own volumes and mounts, which stay.
    volumes = [v["name"] for v in pod["volumes"]]
    assert volumes[-1] == extras["extraVolumes"][0]["name"] and "tmp" in volumes
    mounts = container({"spec": pod}, component)["volumeMounts"]
    assert mounts[-1] == extras["extraVolumeMounts"][0] and {"name": "tmp", "mountPath": "/tmp"} in mounts


def test_pod_extras_render_valid_kubernetes_objects():
    for doc in render_chart(POD_EXTRAS):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            obj = {k: v for k, v in doc.items() if k != "_template"}
            kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_without_pod_extras_the_pods_have_no_priority_runtime_class_or_init_containers():
    for kind, component in (("Deployment", "router"), ("StatefulSet", "worker")):
        pod = find(render_chart({"redis": {"signing": {"enabled": False}}}), kind, f"-{component}")["spec"]
        assert not {"priorityClassName", "runtimeClassName", "initContainers"} & set(pod["template"]["spec"]), \
            component
