"""The NetworkPolicies the chart renders by default, read as the CNI would apply them.

Each policy is evaluated here the way Kubernetes does (a pod is isolated for ingress once a
policy selects it; a connection is admitted when some rule of some policy selecting the target
admits both the source and the port; a rule without ``from`` admits every source), for sources
inside and outside the release: only routers and workers reach Redis, only routers reach the
workers, anyone reaches the routers' API port, and only this namespace (or a configured CIDR)
reaches their admin port.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pytest

from tests.deploy_support import container, find, render_chart

NAMESPACE = "llm"


@dataclass
class Source:
    """A client pod (or an address outside the cluster: no labels, no namespace)."""

    labels: dict[str, str] = field(default_factory=dict)
    namespace: str | None = NAMESPACE
    namespace_labels: dict[str, str] = field(default_factory=dict)
    ip: str = "10.244.9.9"


def _component(name: str) -> Source:
    return Source({"app.kubernetes.io/name": "prefixlb", "app.kubernetes.io/instance": "demo",
                   "app.kubernetes.io/component": name})


ROUTER, WORKER, REDIS = _component("router"), _component("worker"), _component("redis")
TEST_POD = _component("test")
SAME_NAMESPACE_POD = Source({"app": "debug"})
OTHER_NAMESPACE_POD = Source({"app": "api"}, namespace="apps",
                             namespace_labels={"kubernetes.io/metadata.name": "apps"})
MONITORING = Source({"app": "prometheus"}, namespace="monitoring",
                    namespace_labels={"kubernetes.io/metadata.name": "monitoring"})
OUTSIDE = Source({}, namespace=None, ip="203.0.113.7")


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "this evaluator knows matchLabels only"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict, source: Source) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(source.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if source.namespace is None:
        return False  # pod and namespace selectors select pods only
    if "namespaceSelector" in peer:
        in_namespace = _selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        in_namespace = source.namespace == NAMESPACE
    return in_namespace and _selects(peer.get("podSelector", {}), source.labels)


def _port_names(docs: list[dict], target: Source, port: int) -> set:
    """The port number and its container port name(s) on the target's pods."""
    names: set = {port}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet") and _selects(d["spec"]["selector"], target.labels):
            for c in d["spec"]["template"]["spec"]["containers"]:
                names |= {p["name"] for p in c.get("ports", []) if p["containerPort"] == port}
    return names


def reaches(docs: list[dict], source: Source, target: Source, port: int) -> bool:
    """Whether the policies in ``docs`` let ``source`` open a TCP connection to ``port`` of ``target``."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and _selects(d["spec"]["podSelector"], target.labels) and "Ingress" in d["spec"]["policyTypes"]]
    if not policies:
        return True
    names = _port_names(docs, target, port)
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p["port"] in names and p.get("protocol", "TCP") == "TCP" for p in ports):
                continue
            if "from" not in rule or any(_peer_admits(peer, source) for peer in rule["from"]):
                return True
    return False


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render_chart({})


def _ports(docs: list[dict]) -> dict[str, int]:
    router = {p["name"]: p["containerPort"] for p in container(find(docs, "Deployment", "-router"), "router")["ports"]}
    return {"api": router["http"], "admin": router["admin"], "worker": 8000, "redis": 6379}


def test_network_policies_are_on_by_default_for_routers_workers_and_redis(docs):
    policies = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy")
    assert policies == ["demo-prefixlb-redis", "demo-prefixlb-router", "demo-prefixlb-worker"]


def test_only_routers_and_workers_reach_redis(docs):
    port = _ports(docs)["redis"]
    admitted = {name for name, source in {"router": ROUTER, "worker": WORKER, "test": TEST_POD,
                                          "same-namespace": SAME_NAMESPACE_POD, "other-namespace": OTHER_NAMESPACE_POD,
                                          "monitoring": MONITORING, "outside": OUTSIDE}.items()
                if reaches(docs, source, REDIS, port)}
    assert admitted == {"router", "worker"}
    assert not reaches(docs, ROUTER, REDIS, 6380)  # and only on the Redis port


def test_only_routers_reach_the_workers(docs):
    port = _ports(docs)["worker"]
    for source in (WORKER, REDIS, SAME_NAMESPACE_POD, OTHER_NAMESPACE_POD, MONITORING, OUTSIDE):
        assert not reaches(docs, source, WORKER, port), source
    assert reaches(docs, ROUTER, WORKER, port)


def test_anyone_reaches_the_routers_api_port_but_only_the_namespace_their_admin_port(docs):
    ports = _ports(docs)
    for source in (SAME_NAMESPACE_POD, OTHER_NAMESPACE_POD, MONITORING, OUTSIDE, TEST_POD):
        assert reaches(docs, source, ROUTER, ports["api"]), source
    for source in (SAME_NAMESPACE_POD, ROUTER, TEST_POD):
        assert reaches(docs, source, ROUTER, ports["admin"]), source
    for source in (OTHER_NAMESPACE_POD, MONITORING, OUTSIDE):
        assert not reaches(docs, source, ROUTER, ports["admin"]), source
    assert not reaches(docs, OUTSIDE, ROUTER, 9999)  # a port the routers do not serve


def test_the_routers_serve_the_admin_api_on_the_port_the_policy_closes():
    from tests.deploy_support import load_router_config

    docs = render_chart({})
    cfg = load_router_config(container(find(docs, "Deployment", "-router"), "router")["args"])
    assert (cfg.port, cfg.admin_port) == (_ports(docs)["api"], _ports(docs)["admin"])
    # The admin port is not in the Service, so a LoadBalancer Service never publishes it.
    service = find(docs, "Service", "-router")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_api_sources_and_admin_cidrs_are_configurable():
    docs = render_chart({"networkPolicy": {
        "metricsNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "router": {"apiFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}],
                   "adminCidrs": ["203.0.113.0/24"]}}})
    ports = _ports(docs)
    assert reaches(docs, OTHER_NAMESPACE_POD, ROUTER, ports["api"])
    assert reaches(docs, MONITORING, ROUTER, ports["api"])   # Prometheus scrapes /metrics there
    assert reaches(docs, TEST_POD, ROUTER, ports["api"])     # `helm test`
    assert not reaches(docs, SAME_NAMESPACE_POD, ROUTER, ports["api"])
    assert not reaches(docs, OUTSIDE, ROUTER, ports["api"])
    assert reaches(docs, OUTSIDE, ROUTER, ports["admin"])    # from the listed CIDR
    assert not reaches(docs, Source({}, namespace=None, ip="198.51.100.1"), ROUTER, ports["admin"])
    assert reaches(docs, MONITORING, WORKER, ports["worker"])
    assert not reaches(docs, MONITORING, REDIS, ports["redis"])


def test_without_an_admin_port_the_router_policy_has_only_the_api_rule():
    docs = render_chart({"router": {"adminPort": None}})
    policy = find(docs, "NetworkPolicy", "-router")
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    assert [p["name"] for p in container(find(docs, "Deployment", "-router"), "router")["ports"]] == ["http"]


def test_network_policies_can_be_turned_off():
    assert not [d for d in render_chart({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("values,where", [
    ({"networkPolicy": {"router": {"adminCidrs": ["10.0.0.1"]}}}, "/networkPolicy/router/adminCidrs/0"),
    ({"networkPolicy": {"router": {"apiFrom": [{}]}}}, "/networkPolicy/router/apiFrom/0"),
    ({"networkPolicy": {"router": {"apiFrom": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]}}},
     "/networkPolicy/router/apiFrom/0/ipBlock"),
])
def test_malformed_policy_values_fail_the_install(values, where):
    import helm_python as helm

    with pytest.raises(helm.HelmError) as exc:
        render_chart(values)
    assert f"at '{where}'" in str(exc.value)
