"""The chart's LoRA values: the adapters' volume and the workers' --lora list and slot flags."""
from __future__ import annotations

import helm_python as helm
import pytest

from tests.deploy_support import container, expand_pod_env, find, load_server_config, render_chart

LORA = {"worker": {"lora": {
    "enabled": True, "maxLoras": 8, "maxCpuLoras": 64, "maxLoraRank": 32,
    "adapters": [{"name": "sql", "path": "sql"}, {"name": "support", "path": "/elsewhere/support-v2"}],
    "volume": {"enabled": True, "existingClaim": "adapters"}}}}


def _worker(docs: list[dict]) -> dict:
    return find(docs, "StatefulSet", "-worker")


def test_adapters_reach_the_workers_settings_relative_paths_under_the_adapters_volume():
    cfg = load_server_config(expand_pod_env(container(_worker(render_chart(LORA)), "worker")["args"]))
    assert cfg.lora_modules == ["sql=/adapters/sql", "support=/elsewhere/support-v2"]
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank) == (True, 8, 64, 32)


def test_the_adapters_volume_is_mounted_read_only_from_its_claim():
    worker = _worker(render_chart(LORA))
    mounts = {m["name"]: m for m in container(worker, "worker")["volumeMounts"]}
    assert mounts["adapters"] == {"name": "adapters", "mountPath": "/adapters", "readOnly": True}
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    assert volumes["adapters"]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}


def test_without_lora_the_workers_get_no_lora_flag_and_no_adapters_volume():
    worker = _worker(render_chart({}))
    args = container(worker, "worker")["args"]
    assert not [a for a in args if "lora" in a]
    assert "adapters" not in {v["name"] for v in worker["spec"]["template"]["spec"]["volumes"]}


def test_an_adapters_volume_without_a_claim_or_host_path_is_refused():
    with pytest.raises(helm.HelmError) as exc:
        render_chart({"worker": {"lora": {"enabled": True, "volume": {"enabled": True}}}})
    assert "worker.lora.volume.enabled needs" in str(exc.value)


def test_a_misspelt_lora_key_or_an_adapter_name_with_an_equals_sign_fails_the_schema():
    for values in ({"worker": {"lora": {"maxLora": 8}}},
                   {"worker": {"lora": {"adapters": [{"name": "a=b", "path": "x"}]}}}):
        with pytest.raises(helm.HelmError):
            render_chart(values)


def test_the_routers_adapter_placement_knobs_reach_their_settings_and_default_to_the_routers_own():
    from router.config import RouterConfig

    from tests.deploy_support import load_router_config

    def router_cfg(values):
        return load_router_config(container(find(render_chart(values), "Deployment", "-router"), "router")["args"])

    cfg = router_cfg({"router": {"adapterRouting": False, "adapterSpare": 3}})
    assert (cfg.adapter_routing, cfg.adapter_spare) == (False, 3)
    cfg = router_cfg({})
    assert (cfg.adapter_routing, cfg.adapter_spare) == (RouterConfig().adapter_routing, RouterConfig().adapter_spare)
    assert router_cfg({"router": {"adapterRouting": True}}).adapter_routing is True
