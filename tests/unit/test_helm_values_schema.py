"""helm/prefixlb/values.schema.json is strict: a misspelt key anywhere fails the install.

Helm validates the merged values against the schema on install, upgrade, template and lint; with
``additionalProperties: false`` at every level the chart owns, ``router.replica: 3`` (for
``replicas``) is an error naming ``/router`` instead of a setting silently ignored. The only
objects that take any key are string maps (labels, annotations, node selectors, resource
quantities) and the Kubernetes objects the chart copies verbatim into a manifest (their fields
are the API server's to check; tests/unit/test_helm_chart.py validates what the chart renders
against the Kubernetes schemas).
"""
from __future__ import annotations

import copy
import json
from typing import Any, Iterator

import helm_python as helm
import pytest
import yaml

from tests.deploy_support import CHART, render_chart

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
# Objects that take any key, by their name in the values (``*``: an item of a list).
STRING_MAPS = frozenset({"annotations", "podAnnotations", "podLabels", "labels", "nodeSelector",
                         "requests", "limits", "matchLabels"})
KUBERNETES_OBJECTS = frozenset({"podSecurityContext", "affinity", "valueFrom", "claims.*",
                                "topologySpreadConstraints.*", "extraVolumes.*", "initContainers.*",
                                "matchExpressions.*"})
TYPO = "typoKey"


def _schema_objects(node: dict, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """(path, schema) of every object in the schema; ``*`` stands for list items and map values."""
    types = node.get("type")
    if types == "object" or (isinstance(types, list) and "object" in types):
        yield path, node
        for key, child in node.get("properties", {}).items():
            yield from _schema_objects(child, path + (key,))
        if isinstance(node.get("additionalProperties"), dict):
            yield from _schema_objects(node["additionalProperties"], path + ("*",))
    if isinstance(node.get("items"), dict):
        yield from _schema_objects(node["items"], path + ("*",))


def _name(path: tuple) -> str:
    return f"{path[-2]}.*" if path[-1] == "*" else path[-1]


def test_every_object_the_chart_owns_refuses_unknown_keys():
    open_objects = {}
    for path, node in _schema_objects(SCHEMA):
        if node.get("additionalProperties") is False:
            continue
        if isinstance(node.get("additionalProperties"), dict):
            open_objects[path] = "string map"
            assert _name(path) in STRING_MAPS, path
            assert node["additionalProperties"]["type"] in ("string", ["string", "number"]), path
        else:
            open_objects[path] = "kubernetes object"
            assert path == ("global",) or _name(path) in KUBERNETES_OBJECTS, path
            assert path == ("global",) or node["description"].startswith("Kubernetes "), path
    assert () not in open_objects
    # Both kinds are there: the router's and the worker's pod fields, for example.
    assert open_objects[("router", "podSecurityContext")] == "kubernetes object"
    assert open_objects[("worker", "resources", "limits")] == "string map"


def _objects_in_values(node: Any, path: tuple = ()) -> Iterator[tuple]:
    """The path of every mapping in values.yaml (list items included), outside open objects."""
    if isinstance(node, dict):
        if path and (path[-1] in STRING_MAPS or _name(path) in KUBERNETES_OBJECTS or path == ("global",)):
            return
        yield path
        for key, value in node.items():
            yield from _objects_in_values(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, dict) and _name(path + ("*",)) in KUBERNETES_OBJECTS:
                continue
            yield from _objects_in_values(value, path + (i,))


def _with_typo(path: tuple) -> dict:
    values = copy.deepcopy(DEFAULTS)
    node = values
    for part in path:
        node = node[part]
    node[TYPO] = 1
    return values


LEVELS = list(_objects_in_values(DEFAULTS))


def test_values_yaml_has_objects_at_many_levels():
    assert len(LEVELS) > 40
    assert ("router", "ingress", "hosts", 0, "paths", 0) in LEVELS
    assert ("worker", "scheduling", "tolerations", 0) in LEVELS


@pytest.mark.parametrize("path", LEVELS, ids=lambda p: "/".join(map(str, p)) or "root")
def test_a_misspelt_key_at_any_level_fails_the_install_naming_where(path):
    with pytest.raises(helm.HelmError) as exc:
        render_chart(_with_typo(path))
    pointer = "".join(f"/{p}" for p in path)
    assert f"at '{pointer}': additional properties '{TYPO}' not allowed" in str(exc.value)


def test_helm_lint_reports_a_misspelt_key_as_an_error():
    report = helm.lint(CHART, {"router": {"replica": 3}}, kube_version="v1.30.0")
    assert any("at '/router': additional properties 'replica' not allowed" in e for e in report["errors"])


@pytest.mark.parametrize("values", [
    {"router": {"podAnnotations": {"example.com/any-key": "x"}}},
    {"worker": {"scheduling": {"nodeSelector": {"gpu.example.com/model": "h200"}}}},
    {"worker": {"resources": {"limits": {"example.com/fpga": 1}}}},
], ids=["annotation", "node-selector", "extended-resource"])
def test_string_maps_take_any_key(values):
    assert render_chart(values)
